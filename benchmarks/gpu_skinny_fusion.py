"""What each of a decode layer's fusions costs on the skinny GEMM's tiles, on the H200.

    python3 benchmarks/gpu_skinny_fusion.py [--rows 2 4 8 16] [--model-path DIR]

Per Llama-3.1-8B product (bf16, tp 1) and row count: the product as linear() runs it, its tile
with K unsplit, and the tile with each fusion that could ride on it (kernels/skinny_gemm.py
`fusion=`: the norm in front of q|k|v and gate|up, SiLU-mul behind gate|up, the residual add
behind o and down), each timed alone and between two PDL kernels (gpu_gemm_tune.py's Shape,
weights rotated through HBM); then the kernels a fusion removes (RMSNorm with the residual add,
SiLU-mul) at that row count. A fusion pays where its tile's extra time is less than the kernel
it removes (session 26: all of them together made decode 1.7 ms slower at 2-16 rows).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_gemm_tune import Shape, time_graph  # noqa: E402
import gpu_row_fusion as one_row  # noqa: E402  (its SHAPES / HIDDEN / INTER)

FUSIONS = {"qkv": ("norm",), "o": ("residual",), "gate_up": ("gated", "norm", "norm+gated"),
           "down": ("residual",)}


def fusion_of(variant: str, rows: int, columns: int, norm: torch.Tensor):
    from radixserve.layers.kernels.gemv import RowFusion
    parts = variant.split("+")
    residual = torch.randn(rows, columns, device="cuda", dtype=torch.bfloat16)
    return RowFusion(norm if "norm" in parts else None, 1e-5, "gated" in parts,
                     residual if "residual" in parts else None)


def products(rows_list: list[int]) -> None:
    from radixserve.layers import linear as linear_module
    from radixserve.layers.kernels.skinny_gemm import fused_tile_config, skinny_gemm
    norm = 1 + 0.1 * torch.randn(one_row.HIDDEN, device="cuda", dtype=torch.bfloat16)
    for name, (n, k) in one_row.SHAPES.items():
        alone, chained = Shape("bf16", n, k), Shape("bf16", n, k, in_chain=True)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            runs = {"linear()": lambda w: linear_module.linear(x, w)}
            tile = fused_tile_config(n, k, rows, "")
            if tile is None:
                print(f"   M={rows:<2} {name:8s} no tile in the table")
                continue
            runs["tile"] = lambda w, c=tile: skinny_gemm(x, w, c)
            for variant in FUSIONS[name]:
                cfg = fused_tile_config(n, k, rows, variant)
                fusion = fusion_of(variant, rows, n // 2 if "gated" in variant else n, norm)
                runs[variant] = lambda w, c=cfg, f=fusion: skinny_gemm(x, w, c, fusion=f)
            cells = [f"{label} {alone.timed(run) * 1e6:6.1f}/{chained.timed(run) * 1e6:6.1f}"
                     for label, run in runs.items()]
            print(f"   M={rows:<2} {name:8s} us alone/in chain: " + "; ".join(cells), flush=True)
        del alone, chained
        torch.cuda.empty_cache()


def neighbours(rows_list: list[int]) -> None:
    from radixserve.layers.kernels.rmsnorm import fused_rmsnorm
    from radixserve.layers.kernels.silu_and_mul import silu_and_mul
    norm = torch.ones(one_row.HIDDEN, device="cuda", dtype=torch.bfloat16)
    for rows in rows_list:
        x = torch.randn(rows, one_row.HIDDEN, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        act = torch.randn(rows, 2 * one_row.INTER, device="cuda", dtype=torch.bfloat16)
        t_norm = time_graph(lambda: [fused_rmsnorm(x, norm, 1e-5, r) for _ in range(50)]) / 50
        t_silu = time_graph(lambda: [silu_and_mul(act) for _ in range(50)]) / 50
        print(f"   M={rows:<2} back to back: RMSNorm + add {t_norm * 1e6:.1f} us, SiLU-mul "
              f"{t_silu * 1e6:.1f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--model-path", default=None)
    args = parser.parse_args()
    if args.model_path:
        one_row.use_model(args.model_path, 1)
    print("== products (alone / between two PDL kernels)")
    products(args.rows)
    print("== the kernels the fusions remove")
    neighbours(args.rows)


if __name__ == "__main__":
    main()
