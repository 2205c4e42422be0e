"""`python -m radixserve.core.cpu_kernels`: build the CPU kernels now (scripts/setup.sh runs it)."""
from __future__ import annotations

import sys
import time

from radixserve.core.cpu_kernels import build, module_name

if __name__ == "__main__":
    start = time.perf_counter()
    try:
        build(verbose="-v" in sys.argv)
    except Exception as exc:  # noqa: BLE001
        print(f"CPU kernels did not build ({type(exc).__name__}); radixserve will use its "
              f"PyTorch path on CPU. {exc}", file=sys.stderr)
        sys.exit(0 if "--allow-failure" in sys.argv else 1)
    print(f"CPU kernels ready ({module_name()}, {time.perf_counter() - start:.1f} s)")
