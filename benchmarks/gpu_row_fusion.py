"""The batch-1 decode layer's linears with and without the one-row fusions, on the H200.

    python3 benchmarks/gpu_row_fusion.py [--kinds bf16 fp8] [--sweep] [--budget 120]

Per Llama-3.1-8B layer (attention left out): the unfused chain of seven kernels (RMSNorm with
the residual add, q|k|v GEMV, o GEMV, RMSNorm with the residual add, gate|up GEMV, SiLU-mul,
down GEMV) against the fused chain of four (kernels/gemv.py RowFusion: the norms in the q|k|v
and gate|up GEMVs, SiLU-mul in gate|up's, the residual adds in o's and down's), each captured in
a CUDA graph over rotating layer copies so every weight byte comes from HBM. Prints µs per layer
and x 32 per step. --sweep also times each fused kernel over a grid of GEMV configurations
around the one it runs with.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_gemm_tune import time_graph  # noqa: E402

HIDDEN, INTER, QKV = 4096, 14336, 6144
COPIES = 3  # a bf16 layer's linears are 436 MB: three copies are far past the 60 MB L2


class Layer:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
                  "down": (HIDDEN, INTER)}
        self.w: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor | None] = {}
        for name, (n, k) in shapes.items():
            if kind == "fp8":
                self.w[name] = torch.randint(-100, 100, (n, k), device="cuda",
                                             dtype=torch.int16).to(torch.float8_e4m3fn)
                self.scale[name] = torch.rand(n, 1, device="cuda") * 1e-3
            else:
                self.w[name] = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                self.scale[name] = None
        self.norm1 = 1 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.norm2 = 1 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)

    def product(self, name: str, x: torch.Tensor, fusion=None, config=None) -> torch.Tensor:
        from radixserve.layers.kernels.gemv import NO_FUSION, fp8_gemv, gemv
        fusion = fusion or NO_FUSION
        if self.kind == "fp8":
            return fp8_gemv(x, self.w[name], self.scale[name], None, config=config,
                            fusion=fusion)
        return gemv(x, self.w[name], config=config, fusion=fusion)

    def unfused(self, stream: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        from radixserve.layers.kernels.rmsnorm import fused_rmsnorm
        from radixserve.layers.kernels.silu_and_mul import silu_and_mul
        normed, stream = fused_rmsnorm(hidden, self.norm1, 1e-5, stream)
        qkv = self.product("qkv", normed)
        attn_out = qkv[:, :HIDDEN].contiguous()  # stands in for attention's output
        o = self.product("o", attn_out)
        normed, stream = fused_rmsnorm(o, self.norm2, 1e-5, stream)
        act = silu_and_mul(self.product("gate_up", normed))
        return self.product("down", act)

    def fused(self, stream: torch.Tensor) -> torch.Tensor:
        from radixserve.layers.kernels.gemv import RowFusion
        qkv = self.product("qkv", stream, RowFusion(self.norm1, 1e-5))
        attn_out = qkv[:, :HIDDEN].contiguous()
        stream = self.product("o", attn_out, RowFusion(residual=stream))
        act = self.product("gate_up", stream, RowFusion(self.norm2, 1e-5, gated=True))
        return self.product("down", act, RowFusion(residual=stream))


def check(layer: Layer, x: torch.Tensor) -> float:
    """Largest relative difference of the fused chain's q|k|v, activation and output rows."""
    from radixserve.layers.kernels.gemv import RowFusion
    from radixserve.layers.kernels.rmsnorm import fused_rmsnorm
    from radixserve.layers.kernels.silu_and_mul import silu_and_mul
    worst = 0.0
    want = layer.product("qkv", fused_rmsnorm(x, layer.norm1, 1e-5))
    got = layer.product("qkv", x, RowFusion(layer.norm1, 1e-5))
    worst = max(worst, ((got - want).float().abs().max() / want.float().abs().max()).item())
    want = silu_and_mul(layer.product("gate_up", fused_rmsnorm(x, layer.norm2, 1e-5)))
    got = layer.product("gate_up", x, RowFusion(layer.norm2, 1e-5, gated=True))
    worst = max(worst, ((got - want).float().abs().max() / want.float().abs().max()).item())
    act = torch.randn(1, INTER, device="cuda", dtype=torch.bfloat16)
    want = layer.product("down", act) + x
    got = layer.product("down", act, RowFusion(residual=x))
    return max(worst, ((got - want).float().abs().max() / want.float().abs().max()).item())


def sweep(layers: list[Layer], x: torch.Tensor, budget: float) -> None:
    from radixserve.layers.kernels.gemv import (GemvConfig, RowFusion, fused_config,
                                                tuned_gemv_config)
    act = torch.randn(1, INTER, device="cuda", dtype=torch.bfloat16)
    cases = {"qkv": (x, RowFusion(layers[0].norm1, 1e-5)),
             "o": (x, RowFusion(residual=x)),
             "gate_up": (x, RowFusion(layers[0].norm2, 1e-5, gated=True)),
             "down": (act, RowFusion(residual=x))}
    for name, (inp, fusion) in cases.items():
        deadline = time.monotonic() + budget / len(cases)
        n, k = layers[0].w[name].shape
        base = tuned_gemv_config(layers[0].kind, n, k)
        results = []
        for bn, bk, warps, stages in itertools.product((4, 8, 16, 32), (512, 1024), (4, 8),
                                                       (3, 4)):
            if time.monotonic() > deadline or k % bk:
                continue
            config = GemvConfig(bn, bk, warps, stages)
            try:
                t = time_graph(lambda: [layer.product(name, inp, fusion, config)
                                        for layer in layers]) / len(layers)
            except Exception:  # out of registers / shared memory
                continue
            results.append((t, config))
        results.sort()
        t_base = time_graph(lambda: [layer.product(name, inp, fusion) for layer in layers]) \
            / len(layers)
        print(f"   {name:8s} runs {fused_config(base, fusion)} {t_base * 1e6:7.1f} us; best: "
              + "; ".join(f"{c} {t * 1e6:.1f}" for t, c in results[:3]))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per kind's sweep")
    args = parser.parse_args()
    for kind in args.kinds:
        layers = [Layer(kind) for _ in range(COPIES)]
        stream = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
        hidden = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
        print(f"== {kind}: fused vs unfused rows differ by at most "
              f"{check(layers[0], stream):.2e} (relative to the largest)")
        t_unfused = time_graph(lambda: [layer.unfused(stream, hidden) for layer in layers]) \
            / COPIES
        t_fused = time_graph(lambda: [layer.fused(stream) for layer in layers]) / COPIES
        print(f"   per layer: unfused {t_unfused * 1e6:.1f} us, fused {t_fused * 1e6:.1f} us; "
              f"x 32 layers: {t_unfused * 32e3:.3f} -> {t_fused * 32e3:.3f} ms")
        if args.sweep:
            sweep(layers, stream, args.budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
