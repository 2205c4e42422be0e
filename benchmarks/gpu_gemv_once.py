"""One-row decode products (the GEMV of layers/kernels/gemv.py) launched eagerly a few times,
for a profiler to look inside one launch (Nsight Compute), bf16 and FP8 weights side by side:

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section Occupancy --section LaunchStats \\
        -k regex:_gemv_kernel --launch-skip 1 --launch-count 1 \\
        python3 benchmarks/gpu_gemv_once.py --product o --kind fp8

Llama-3.1-8B's shapes (benchmarks/model_shapes.py), random weights (FP8: per-channel codes and
scales, as --quantization fp8 makes them), the configuration the tables give the plain product.
ncu flushes the caches before each profiled launch, so the weight comes from HBM. Figures come
from the profiler; this script prints the shape and the configuration.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_shapes import decode_product_shapes  # noqa: E402
from radixserve.layers.kernels.gemv import (NO_FUSION, fp8_gemv, fp8_gemv_config,  # noqa: E402
                                            gemv, row_config)
from radixserve.layers.quantization.fp8 import quantize_per_channel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--product", choices=["qkv", "o", "gate_up", "down", "lm_head"],
                        default="o")
    parser.add_argument("--kind", choices=["bf16", "fp8"], default="fp8")
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    n, k = decode_product_shapes()[args.product]
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    if args.kind == "fp8":
        codes, scale = quantize_per_channel(weight)
        del weight
        config = fp8_gemv_config(codes, scale, None)
        run = lambda: fp8_gemv(x, codes, scale, None, config=config)  # noqa: E731
    else:
        config = row_config("bf16", n, k, NO_FUSION)
        run = lambda: gemv(x, weight, config=config)  # noqa: E731
    for _ in range(args.launches):
        run()
    torch.cuda.synchronize()
    print(f"{args.product} {n} x {k}, {args.kind}: {config}")


if __name__ == "__main__":
    main()
