"""The batch-1 decode layer's linears with and without the one-row fusions, on the H200.

    python3 benchmarks/gpu_row_fusion.py [--kinds bf16 fp8] [--sweep] [--budget 120] [--write]
        [--bf16-vecs 8 1]

Per Llama-3.1-8B layer (or --model-path's, at tp 1: the only size that fuses; attention left
out): the unfused chain of seven kernels (RMSNorm with
the residual add, q|k|v GEMV, o GEMV, RMSNorm with the residual add, gate|up GEMV, SiLU-mul,
down GEMV) against the fused chain of four (kernels/gemv.py RowFusion: the norms in the q|k|v
and gate|up GEMVs, SiLU-mul in gate|up's, the residual adds in o's and down's), each captured in
a CUDA graph over rotating layer copies so every weight byte comes from HBM. Prints µs per layer
and x 32 per step. --sweep also times each fused kernel over a grid of GEMV configurations
around the one it runs with; --write stores each winner in the kernels' tables
(kernels/gemm_tables.py, the M = 1 entry's "norm" / "norm+gated" / "residual" keys; a GEMV
that beats the FP8 tensor-core kernel where that ran replaces its "mma" entry).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.model_shapes import DEFAULT_MODEL, decode_product_shapes  # noqa: E402
from gpu_gemm_tune import time_graph  # noqa: E402

COPIES = 3  # a bf16 layer's linears are 436 MB: three copies are far past the 60 MB L2
# a layer's products, and the widths around them: the residual stream (HIDDEN), o_proj's input
# (O_IN) and down_proj's (INTER); Llama-3.1-8B unless use_model points elsewhere
SHAPES: dict[str, tuple[int, int]] = {}
HIDDEN = O_IN = INTER = 0


def use_model(model_path: str | Path = DEFAULT_MODEL, tp_size: int = 1) -> None:
    """The shapes of another model, or of one of tp_size ranks (SHAPES is updated in place:
    gpu_fp8_mma.py shares it)."""
    global HIDDEN, O_IN, INTER
    shapes = decode_product_shapes(model_path, tp_size)
    SHAPES.clear()
    SHAPES.update({name: shapes[name] for name in ("qkv", "o", "gate_up", "down")})
    (HIDDEN, O_IN), INTER = SHAPES["o"], SHAPES["down"][1]


use_model()


def one_row(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, fusion=None,
            config=None) -> torch.Tensor:
    """The package's GEMV over bf16 weights, or over FP8 codes when a scale is given (without
    a GEMV `config`: the model's FP8 dispatch, which may take the tensor-core kernel)."""
    from radixserve.layers.kernels.fp8_gemm import fp8_rows_product
    from radixserve.layers.kernels.gemv import NO_FUSION, fp8_gemv, gemv
    fusion = fusion or NO_FUSION
    if scale is not None and config is None:
        return fp8_rows_product(x, w, scale, None, fusion=fusion)
    if scale is not None:
        return fp8_gemv(x, w, scale, None, config=config, fusion=fusion)
    return gemv(x, w, config=config, fusion=fusion)


class Layer:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.w: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor | None] = {}
        for name, (n, k) in SHAPES.items():
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
        return one_row(x, self.w[name], self.scale[name], fusion, config)

    def unfused(self, stream: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        from radixserve.layers.kernels.rmsnorm import fused_rmsnorm
        from radixserve.layers.kernels.silu_and_mul import silu_and_mul
        normed, stream = fused_rmsnorm(hidden, self.norm1, 1e-5, stream)
        qkv = self.product("qkv", normed)
        attn_out = qkv[:, :O_IN].contiguous()  # stands in for attention's output
        o = self.product("o", attn_out)
        normed, stream = fused_rmsnorm(o, self.norm2, 1e-5, stream)
        act = silu_and_mul(self.product("gate_up", normed))
        return self.product("down", act)

    def fused(self, stream: torch.Tensor) -> torch.Tensor:
        from radixserve.layers.kernels.gemv import RowFusion
        qkv = self.product("qkv", stream, RowFusion(self.norm1, 1e-5))
        attn_out = qkv[:, :O_IN].contiguous()
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


VARIANTS = {"qkv": "norm", "o": "residual", "gate_up": "norm+gated", "down": "residual"}


def sweep(kind: str, budget: float, write: bool, bf16_vecs: tuple[int, ...] = (1,)) -> None:
    """Each fused product over a grid of GEMV configurations, weights rotated through >= 600 MB
    (gpu_gemm_tune.Shape); with `write`, a winner 2% or more ahead of the configuration the
    product runs with now goes into its table's M = 1 entry under the variant's name."""
    from gpu_gemm_tune import MARGIN, Shape

    from radixserve.layers.kernels import gemm_tables
    from radixserve.layers.kernels.gemv import GemvConfig, RowFusion, row_config
    norm = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    stream = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    for name, (n, k) in SHAPES.items():
        shape = Shape(kind, n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        fusion = RowFusion(residual=stream) if VARIANTS[name] == "residual" else \
            RowFusion(norm, 1e-5, gated=name == "gate_up")

        def product(w, config=None):  # type: ignore[no-untyped-def]
            return one_row(x, w, shape.scale, fusion, config)

        current = row_config(kind, n, k, fusion)
        t_current = shape.timed(product)
        t_plain = shape.timed(lambda w: one_row(x, w, shape.scale))
        deadline = time.monotonic() + budget / len(SHAPES)
        results = []
        # FP8 also with each thread's 16 codes (one 16-byte load) summed before they are
        # accumulated (GemvConfig.vec: fewer registers, so more programs per SM), and then with
        # longer steps too. bf16 with vec 8 won 0.5-1 us on q|k|v and o in isolation but left
        # the batch-1 step level on an H100 (session 32): bf16 sweeps the plain tiles unless
        # --bf16-vecs asks (e.g. "8 1" on an H200, whose batch-1 step is further from its limit)
        vecs = (16, 1) if kind == "fp8" else bf16_vecs
        for vec, bn, bk, warps, stages in itertools.product(vecs, (4, 8, 16, 32),
                                                            (512, 1024, 2048), (4, 8), (3, 4)):
            if time.monotonic() > deadline or k % bk or (bk == 2048 and vec == 1):
                continue
            config = GemvConfig(bn, bk, warps, stages, vec)
            results.append((shape.timed(lambda w, c=config: product(w, c)), config))
        results.sort(key=lambda pair: pair[0])
        print(f"   {name:8s} plain GEMV {t_plain * 1e6:6.1f} us; {VARIANTS[name]} with "
              f"{tuple(current)} {t_current * 1e6:6.1f} us; best of {len(results)}: "
              + "; ".join(f"{tuple(c)} {t * 1e6:.1f}" for t, c in results[:3]), flush=True)
        if write and results and results[0][0] * MARGIN < t_current:
            t_best, best = results[0]
            path = gemm_tables.writable_table(kind, n, k)
            table = json.loads(path.read_text()) if path.is_file() else {}
            entry = table.setdefault("1", {})
            entry[VARIANTS[name]] = dict(
                best._asdict(), us=round(t_best * 1e6, 2), base_us=round(t_current * 1e6, 2))
            # the product ran on the FP8 tensor-core kernel, whose entry takes precedence
            # (fp8_gemm.fp8_rows_product): the faster GEMV replaces it
            if entry.get("mma", {}).pop(VARIANTS[name], None) is not None:
                print("   (its tensor-core entry removed: the GEMV beat it)", flush=True)
                if not entry["mma"]:
                    del entry["mma"]
            path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
            print(f"   -> {path.name}", flush=True)
        torch.cuda.empty_cache()
    gemm_tables.clear_cache()


def chain(kind: str) -> None:
    layers = [Layer(kind) for _ in range(COPIES)]
    stream = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    print(f"== {kind}: fused vs unfused rows differ by at most "
          f"{check(layers[0], stream):.2e} (relative to the largest)")
    t_unfused = time_graph(lambda: [layer.unfused(stream, hidden) for layer in layers]) / COPIES
    t_fused = time_graph(lambda: [layer.fused(stream) for layer in layers]) / COPIES
    print(f"   per layer: unfused {t_unfused * 1e6:.1f} us, fused {t_fused * 1e6:.1f} us; "
          f"x 32 layers: {t_unfused * 32e3:.3f} -> {t_fused * 32e3:.3f} ms", flush=True)
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per kind's sweep")
    parser.add_argument("--write", action="store_true", help="store the sweep's winners")
    parser.add_argument("--bf16-vecs", type=int, nargs="+", default=[1],
                        help="GemvConfig.vec values in bf16's sweep grid (e.g. 8 1)")
    parser.add_argument("--model-path", default=str(DEFAULT_MODEL))
    args = parser.parse_args()
    # one rank only: at tp > 1 the residual adds wait for the all-reduce, and the decode
    # layer does not fuse rows
    use_model(args.model_path)
    for kind in args.kinds:
        chain(kind)
        if args.sweep:
            sweep(kind, args.budget, args.write, tuple(args.bf16_vecs))
            chain(kind)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
