"""Where the host waits for the GPU during serving: every synchronizing CUDA call that PyTorch's
sync debug mode reports while an offline workload runs, grouped by the radixserve line that
made it, with counts. The overlap schedule expects exactly one kind per pass, the read-back of
sampled ids (an event wait, which the debug mode does not report); anything listed here stalls
the pipeline (a blocking host-to-device copy, `.item()`, `.tolist()` of a device tensor).

    python3 benchmarks/gpu_sync_points.py [--num-prompts 300] [--input-len 128]
        [--output-len 8] [engine flags as key=value]
"""
from __future__ import annotations

import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.dummy_engine import dummy_engine, greedy_params, workload_parser  # noqa: E402


def main() -> None:
    args = workload_parser(default_prompts=300).parse_args()
    engine = dummy_engine(args)
    vocab = engine.scheduler.runner.vocab_size
    prompts = [[(7 * i + 3 * j) % (vocab - 1) + 1 for j in range(args.input_len)]
               for i in range(args.num_prompts)]
    params = greedy_params(args)
    engine.generate(input_ids=prompts[:16], sampling_params=params)  # warm-up, compiles
    sites: Counter[str] = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "radixserve" in f.filename
                  and "gpu_sync_points" not in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                            for f in reversed(frames[-3:])) or f"{filename}:{lineno}"
        sites[where] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"synchronizing calls during {args.num_prompts} x {args.input_len}/{args.output_len}: "
          f"{sum(sites.values())} at {len(sites)} sites")
    for where, count in sites.most_common(30):
        print(f"{count:8d}  {where}")
    engine.shutdown()


if __name__ == "__main__":
    main()
