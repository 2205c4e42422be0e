"""How much Hopper's unpromoted e4m3 accumulation moves the one-launch FP8 MLP's output
(kernels/dataflow_mlp.py) against tests/layers/test_dataflow_mlp.py's exact W8A8 reference, on
the CPU: each chained k32 MMA's running sum is truncated to BITS mantissa bits (wgmma keeps ~14),
through the gate|up product, the bf16 rounding, the activation's per-K-step requantisation and
the down product.

    python3 benchmarks/cpu_fp8_accumulation.py [--bits 0 14 13 12]

Per case and BITS (0: exact): the share of outputs past the test's elementwise tolerance, the
largest error, the relative error in all and in the worst row.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
DTYPE = torch.bfloat16


def _codes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = t.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
    return (t.float() / scale).to(FP8).float(), scale


def _truncate(x: torch.Tensor, bits: int) -> torch.Tensor:
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.trunc(mantissa * 2 ** bits) / 2 ** bits, exponent)


def _chained_dot(a: torch.Tensor, b: torch.Tensor, bits: int) -> torch.Tensor:
    """a @ b as chained k32 MMAs whose running sum keeps `bits` mantissa bits (0: exact)."""
    acc = torch.zeros(a.shape[0], b.shape[1])
    for start in range(0, a.shape[1], 32):
        acc = acc + a[:, start:start + 32] @ b[start:start + 32]
        if bits:
            acc = _truncate(acc, bits)
    return acc


def _mlp(x, xs, gu, gus, d, ds, block_k: int, bits: int) -> torch.Tensor:
    """The kernel's W8A8 arithmetic: gate|up's codes products then scales, bf16, SiLU-mul,
    each block_k step of the activation requantised per row for the down product."""
    rows, inter = x.shape[0], d.shape[1]
    g = (_chained_dot(x, gu.t(), bits) * xs * gus.t()).to(DTYPE).float()
    act = (F.silu(g[:, :inter]).to(DTYPE).float() * g[:, inter:]).to(DTYPE).float()
    groups = act.view(rows, -1, block_k)
    scale = groups.abs().amax(dim=2, keepdim=True).clamp_min(1e-30) / 448.0
    codes = (groups / scale).to(FP8).float()
    y = sum(_chained_dot(codes[:, j], d[:, j * block_k:(j + 1) * block_k].t(), bits)
            * scale[:, j] for j in range(inter // block_k))
    return (y * ds.t()).to(DTYPE).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[0, 14, 13, 12])
    args = parser.parse_args()
    for rows, hidden, inter, block_k in ((3, 64, 128, 32), (16, 96, 192, 64)):
        gen = torch.Generator().manual_seed(rows + inter)  # the test's operands
        x, xs = _codes(torch.randn(rows, hidden, generator=gen) * 3)
        gu, gus = _codes(torch.randn(2 * inter, hidden, generator=gen) / hidden ** 0.5)
        d, ds = _codes(torch.randn(hidden, inter, generator=gen) / inter ** 0.5)
        want = _mlp(x, xs, gu, gus, d, ds, block_k, 0)
        for bits in args.bits:
            got = _mlp(x, xs, gu, gus, d, ds, block_k, bits)
            diff = (got - want).abs()
            past = (diff > 2e-2 + 4e-3 * want.abs()).float().mean().item()
            rows_error = (got - want).norm(dim=1) / want.norm(dim=1)
            print(f"{rows:2d} x {hidden} -> {inter}, K step {block_k}, bits {bits:2d}: "
                  f"past the elementwise bound {past:.3f}, largest error {diff.max():.3f}, "
                  f"relative {((got - want).norm() / want.norm()).item():.4f}, "
                  f"worst row {rows_error.max().item():.4f}")


if __name__ == "__main__":
    main()
