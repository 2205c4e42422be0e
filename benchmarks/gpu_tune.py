"""Exploration timings on the H200 that decide kernel choices (not part of the figures).

    python3 benchmarks/gpu_tune.py [--only gemm|attn|read]

gemm: the decode GEMMs of Llama-3.1-8B (M = 1, 8) through cuBLAS (F.linear) against a Triton
      GEMV, each over rotating weight copies so reads come from HBM; GB/s of weights read.
attn: the split-KV decode kernel over a grid of (block_n, warps, stages) at batch 1 / 256 / 512.
read: a plain read-only reduction over 4 GiB, the read bandwidth ceiling.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DTYPE = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, bn: int, bk: int, warps: int,
         stages: int) -> torch.Tensor:
    from radixserve.layers.kernels.gemv import GemvConfig
    from radixserve.layers.kernels.gemv import gemv as package_gemv
    return package_gemv(x, w, config=GemvConfig(bn, bk, warps, stages))  # y: unused


def time_graph(fn) -> float:
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=30) * 1e-3


def bench_gemm() -> None:
    print("== GEMM (weights GB/s; cuBLAS F.linear vs Triton GEMV, M=1)")
    total = {"cublas": 0.0, "best_triton": 0.0}
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-(600 << 20) // nbytes))
        ws = [torch.randn((n, k), dtype=DTYPE, device="cuda") * 0.02 for _ in range(copies)]
        for m in (1,):
            x = torch.randn((m, k), dtype=DTYPE, device="cuda")
            t = time_graph(lambda: [torch.nn.functional.linear(x, w) for w in ws]) / copies
            print(f"{name:8s} M={m:<3} cublas {t * 1e6:8.1f} us {nbytes / t / 1e9:7.0f} GB/s")
            if m == 1:
                total["cublas"] += t * (32 if name != "lm_head" else 1)
        x = torch.randn((k,), dtype=DTYPE, device="cuda")
        y = torch.empty((n,), dtype=DTYPE, device="cuda")
        ref = torch.nn.functional.linear(x[None], ws[0])[0].float()
        best = None
        if name == "gate_up" or name == "lm_head":
            grid = list(itertools.product((16,), (256,), (4,), (3,)))
        else:
            grid = list(itertools.product((2, 4, 8), (512, 1024), (4, 8), (2, 3, 4)))
        for bn, bk, warps, stages in grid:
            if bn * bk > 16384 or k % bk:
                continue
            try:
                y = gemv(x, ws[0], y, bn, bk, warps, stages)
                err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                t = time_graph(lambda: [gemv(x, w, y, bn, bk, warps, stages) for w in ws]) / copies
            except Exception as exc:  # noqa: BLE001
                print(f"  triton n{bn} k{bk} w{warps} s{stages}: failed {exc!s:.80}")
                continue
            if best is None or t < best[0]:
                best = (t, f"n{bn} k{bk} w{warps} s{stages} relerr {err:.1e}")
        assert best is not None
        print(f"{name:8s} M=1   triton best {best[0] * 1e6:8.1f} us "
              f"{nbytes / best[0] / 1e9:7.0f} GB/s  ({best[1]})")
        total["best_triton"] += best[0] * (32 if name != "lm_head" else 1)
        ws.clear()
        torch.cuda.empty_cache()
    print(f"one step's GEMMs at M=1: cuBLAS {total['cublas'] * 1e3:.3f} ms, "
          f"best Triton per shape {total['best_triton'] * 1e3:.3f} ms")


def bench_attn() -> None:
    from gpu_kernels import bench_decode, decode_report, kv_splits_for
    from radixserve.attention.kernels.decode_attention import DecodeKernelConfig
    print("== decode attention sweep (random slots)")
    for bs, ctx in ((1, 1024), (256, 1536), (512, 1536)):
        plan = kv_splits_for(bs)
        rows = []
        for bn, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
            for splits in sorted({plan, max(1, plan // 2), plan * 2}):
                if bs > 1 and splits != plan:
                    continue
                try:
                    t = bench_decode(bs, ctx, splits, DecodeKernelConfig(bn, warps, stages))
                except Exception as exc:  # noqa: BLE001
                    print(f"  n{bn}w{warps}s{stages}: failed {exc!s:.80}")
                    continue
                rows.append((t, decode_report(bs, ctx, t, f"splits={splits} n{bn}w{warps}s{stages}")))
        rows.sort()
        for _, line in rows[:6]:
            print(line)
        default = [line for _, line in rows if f"splits={plan} n64w4s2" in line]
        print("default:", default[0] if default else "?")
        torch.cuda.empty_cache()


def bench_read() -> None:
    x = torch.randn((1 << 31,), dtype=DTYPE, device="cuda")
    out = torch.empty((), dtype=torch.float32, device="cuda")
    t = time_graph(lambda: torch.sum(x, dtype=torch.float32, out=out))
    print(f"== read: torch.sum over 4 GiB bf16: {x.numel() * 2 / t / 1e12:.2f} TB/s")
    y = torch.empty_like(x)
    t = time_graph(lambda: y.copy_(x))
    print(f"== copy: 4 GiB: {x.numel() * 2 / t / 1e12:.2f} TB/s (bytes copied; traffic x2)")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["gemm", "attn", "read"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    torch.manual_seed(0)
    for name, fn in (("read", bench_read), ("gemm", bench_gemm), ("attn", bench_attn)):
        if args.only in (None, name):
            fn()
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
