"""Sweep the FP8 weight kernels on the H200 for Llama-3.1-8B / 70B (tp 2) shapes; prints the
best configuration per (shape, M) and the weight-read bandwidth it reaches, to choose
`gemv_config` / `fp8_gemm._config` values (issue 13's decode goal: batch 1 <= 2.2 ms).

    python3 benchmarks/gpu_fp8_tune.py [--m 1 8 32] [--budget 240]

M = 1 sweeps the FP8 GEMV (block_n, block_k, warps, stages); M > 1 sweeps the tile GEMM
(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages). Timed with CUDA graphs over rotating weight copies
so every read comes from HBM. Per-channel scales (the --quantization fp8 layout).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "70b_gate_up_tp2": (28672, 8192), "70b_down_tp2": (8192, 14336)}
COPIES = 4  # weight copies rotated through, > the L2 cache together


def time_graph(fn) -> float:
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=20) * 1e-3


def sweep_gemv(name: str, n: int, k: int) -> tuple[float, tuple]:
    from radixserve.layers.kernels import gemv as g
    weights = [torch.randint(-100, 100, (n, k), device="cuda").to(torch.float8_e4m3fn)
               for _ in range(COPIES)]
    scale = torch.rand(n, 1, device="cuda") * 1e-3
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    best = (float("inf"), ())
    for bn, bk, warps, stages in itertools.product((2, 4, 8, 16, 32), (256, 512, 1024, 2048),
                                                   (4, 8), (2, 3, 4)):
        if k % bk:
            continue

        def run() -> None:
            for w in weights:
                g._fp8_gemv_kernel[(triton.cdiv(n, bn),)](
                    x, w, scale, scale, y, n, k, w.stride(0), scale.stride(0), HAS_BIAS=False,
                    GROUPED=False, GROUP_K=k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                    num_stages=stages, USE_PDL=False)
        try:
            seconds = time_graph(run) / COPIES
        except Exception:  # out of resources
            continue
        best = min(best, (seconds, (bn, bk, warps, stages)))
    return best


def sweep_gemm(name: str, n: int, k: int, m: int) -> tuple[float, tuple]:
    from radixserve.layers.kernels import fp8_gemm as f
    weights = [torch.randint(-100, 100, (n, k), device="cuda").to(torch.float8_e4m3fn)
               for _ in range(COPIES)]
    scale = torch.rand(n, 1, device="cuda") * 1e-3
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    best = (float("inf"), ())
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    for bn, bk, split, warps, stages in itertools.product((32, 64, 128), (64, 128, 256),
                                                          (1, 2, 4, 8), (4, 8), (3, 4)):
        if k // split < bk:
            continue
        y = torch.zeros(m, n, device="cuda", dtype=torch.float32 if split > 1 else x.dtype)
        k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk

        def run() -> None:
            for w in weights:
                f._fp8_weight_gemm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, block_m), split)](
                    x, w, scale, scale, y, m, n, k, k_per, x.stride(0), w.stride(0),
                    scale.stride(0), y.stride(0), HAS_BIAS=False, GROUPED=False, GROUP_K=k,
                    BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
                    num_stages=stages, USE_PDL=False)
        try:
            seconds = time_graph(run) / COPIES
        except Exception:
            continue
        best = min(best, (seconds, (bn, bk, split, warps, stages)))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--budget", type=float, default=240.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_fp8_tune: no CUDA device")
        return 0
    deadline = time.time() + args.budget
    for m in args.m:
        for name, (n, k) in SHAPES.items():
            if time.time() > deadline:
                print("budget spent")
                return 0
            seconds, cfg = sweep_gemv(name, n, k) if m == 1 else sweep_gemm(name, n, k, m)
            print(f"M={m:<3} {name:<16} N={n:<6} K={k:<6} best {cfg}: {seconds * 1e6:8.1f} us "
                  f"{n * k / seconds / 1e12:5.2f} TB/s of FP8 weights", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
