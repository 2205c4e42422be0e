"""FP8 decode products on the e4m3 tensor cores (kernels/fp8_mma_rows.py) against the kernels
they would replace, on the H200; --write stores the winners in the kernels' tables.

    python3 benchmarks/gpu_fp8_mma.py [--budget 240] [--write] [--rows 1 8 16] [--codes]

--codes sweeps the kernel on activation codes quantised beforehand instead (see codes_sweep;
`--codes --rows 8 16 --write` writes the "codes" entries DecoderLayer.forward_fp8_rows needs,
`--codes --rows 32 64 128 --write` those of 17-128 rows).

Per Llama-3.1-8B FP8 shape (or --model-path's on one of --tp-size ranks; per-channel scales,
as --quantization fp8 makes them):
  M = 1:  each one-row fusion the decode layer runs (q|k|v with the input norm, o and down with
          the residual add, gate|up with the norm and SiLU-mul) against the FP8 GEMV with its
          swept variant configuration;
  M = 8:  the plain product over a grid of configurations against what fp8_weight_matmul runs
          without this kernel (the skinny tile GEMM or _scaled_mm, per the table);
  M = 16: the five best configurations of M = 8; M = 2 and 4 get M = 8's outcome (at 2-16
          rows both kernels take the same time: the tiles are 16 rows whatever M is).
Each candidate is timed as the caller runs it, in a CUDA graph over rotating weight copies
(gpu_gemm_tune.Shape), and the winner's error against the dequantised float32 product is
printed, with one and two activation terms (two, ~bf16 activations, unless one term is 2%
faster: one term is the dynamic FP8 activations --quantization fp8 specifies). A winner 2% or more ahead of the incumbent goes in
the table's entry for M under "mma" (keyed by the fusion's name, "" for none); a stale one is
removed when the incumbent wins.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.model_shapes import DEFAULT_MODEL  # noqa: E402
from gpu_gemm_tune import MARGIN, Shape  # noqa: E402
from gpu_row_fusion import SHAPES, VARIANTS, use_model  # noqa: E402

# the others try the five best of M = 8; 32-128 rows (activation codes only) tile differently
FULL_SWEEP_ROWS = (1, 8, 32, 64, 128)
SMS = 132
COPIED_ROWS = {2: 8, 4: 8}  # entries written with M = 8's outcome: at 2-16 rows both kernels
# take the same time (the tiles are 16 rows whatever M is; session 11's first sweep)


def candidates(n_out: int, k: int):
    """The grid, the configurations nearest ~4 programs per SM (tiles x splits) first, so a
    budget cut keeps the likeliest."""
    from radixserve.layers.kernels.fp8_mma_rows import MmaRowsConfig
    grid = []
    for (block_n, warps), block_k, split in itertools.product(
            ((64, 4), (128, 4), (128, 8)), (128, 256), (1, 2, 4, 8)):
        if k % block_k or k // split < 2 * block_k:
            continue
        programs = -(-n_out // block_n) * split
        grid.append((abs(math.log2(programs / (4 * SMS))), MmaRowsConfig(
            block_n, block_k, warps, 4 if block_k == 128 else 3, 2, split)))
    return [config for _, config in sorted(grid, key=lambda pair: pair[0])]


def fusion_for(name: str, m: int, n: int, k: int):
    """The fusion the decode layer runs this product with at M = 1 (none above)."""
    from radixserve.layers.kernels.gemv import NO_FUSION, RowFusion
    if m > 1:
        return NO_FUSION
    if VARIANTS[name] == "residual":
        return RowFusion(residual=torch.randn(m, n, device="cuda", dtype=torch.bfloat16))
    norm = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
    return RowFusion(norm, 1e-5, gated=name == "gate_up")


def incumbent(x, w, scale, fusion):
    """What the model runs for this product with the tensor-core kernel switched off."""
    from radixserve.layers.kernels import fp8_mma_rows
    from radixserve.layers.kernels.fp8_gemm import fp8_rows_product, fp8_weight_matmul
    enabled, fp8_mma_rows.ENABLED = fp8_mma_rows.ENABLED, False
    try:
        if x.shape[0] == 1:
            return fp8_rows_product(x, w, scale, None, fusion=fusion)
        return fp8_weight_matmul(x, w, scale, None, None)
    finally:
        fp8_mma_rows.ENABLED = enabled


def errors(x, w, scale, fusion, config) -> str:
    """The kernel's largest error against the dequantised float32 product (plain products
    only: the fused ones are tested in tests/layers/test_fp8_mma_rows.py), 1 and 2 terms."""
    from radixserve.layers.kernels.fp8_gemm import fp8_weight_gemm_reference
    from radixserve.layers.kernels.fp8_mma_rows import fp8_mma_rows
    if fusion.variant:
        return ""
    want = fp8_weight_gemm_reference(x, w, scale, None)
    parts = []
    for terms in (1, 2):
        got = fp8_mma_rows(x, w, scale, None, config=config._replace(x_terms=terms)).float()
        parts.append(f"{terms} term(s) {((got - want).abs().max() / want.abs().max()).item():.1e}")
    return "; error " + ", ".join(parts)


def store(name: str, n: int, k: int, m: int, variant: str, entry: dict | None) -> None:
    from radixserve.layers.kernels import gemm_tables
    path = gemm_tables.writable_table("fp8", n, k)
    table = json.loads(path.read_text()) if path.is_file() else {}
    mma = table.setdefault(str(m), {}).setdefault("mma", {})
    if entry is None:
        mma.pop(variant, None)
    else:
        mma[variant] = entry
    if not mma:
        del table[str(m)]["mma"]
        if not table[str(m)]:  # nothing else swept at m: no entry to shadow larger row counts
            del table[str(m)]
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    gemm_tables.clear_cache()


def store_outcome(name: str, n: int, k: int, m: int, variant: str, best, t_best: float,
                  t_base: float) -> None:
    """The winner of m rows into the table (and into the rows that copy m), or its stale entry
    out when it is not 2% ahead of the incumbent."""
    wins = t_best * MARGIN < t_base
    entry = dict(best._asdict(), us=round(t_best * 1e6, 2), base_us=round(t_base * 1e6, 2))
    for rows in [m] + [r for r, source in COPIED_ROWS.items() if source == m]:
        store(name, n, k, rows, variant,
              (entry if rows == m else dict(entry, measured_at=m)) if wins else None)


def time_grid(shape: Shape, grid: list, product, case_deadline: float) -> list:
    """(seconds, configuration) for each of grid, in order until case_deadline passes, timed
    as product(weight, configuration); fastest first."""
    results = []
    for config in grid:
        if time.monotonic() > case_deadline:
            break
        results.append((shape.timed(lambda w, c=config: product(w, c)), config))
    return sorted(results, key=lambda pair: pair[0])


def case_deadlines(rows: list[int], budget: float):
    """(m, name, deadline) per (rows, shape) case: the budget left shared evenly among
    the cases left."""
    deadline = time.monotonic() + budget
    cases = [(m, name) for m in rows for name in SHAPES]
    for index, (m, name) in enumerate(cases):
        yield m, name, time.monotonic() + (deadline - time.monotonic()) / (len(cases) - index)


def sweep(rows: list[int], budget: float, write: bool) -> None:
    from radixserve.layers.kernels.fp8_mma_rows import fp8_mma_rows
    from radixserve.layers.kernels.fp8_mma_rows import MAX_ROWS
    ranked: dict[str, list] = {}
    for m, name, case_deadline in case_deadlines(rows, budget):
        if m > MAX_ROWS:
            print(f"   M={m}: past the {MAX_ROWS} rows the kernel quantises in registers "
                  "(--codes sweeps more rows of activation codes)", flush=True)
            continue
        n, k = SHAPES[name]
        shape = Shape("fp8", n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        fusion = fusion_for(name, m, n, k)
        t_base = shape.timed(lambda w: incumbent(x, w, shape.scale, fusion))
        n_out = n // 2 if fusion.gated else n
        grid = candidates(n_out, k) if m in FULL_SWEEP_ROWS or name not in ranked else \
            [config for _, config in ranked[name][:5]]
        results = time_grid(shape, grid, lambda w, c: fp8_mma_rows(
            x, w, shape.scale, None, c, fusion=fusion), case_deadline)
        if m == 8:
            ranked[name] = results
        if not results:
            print(f"   M={m:<2} {name:8s} no candidate timed (budget)", flush=True)
            continue
        t_best, best = results[0]
        t_one = shape.timed(lambda w: fp8_mma_rows(x, w, shape.scale, None,
                                                   config=best._replace(x_terms=1),
                                                   fusion=fusion))
        print(f"   M={m:<2} {name:8s} {fusion.variant or 'plain':10s} incumbent "
              f"{t_base * 1e6:6.1f} us ({shape.nbytes / t_base / 1e12:4.2f} TB/s); mma best of "
              f"{len(results)} {tuple(best)} {t_best * 1e6:6.1f} us "
              f"({shape.nbytes / t_best / 1e12:4.2f} TB/s), one term {t_one * 1e6:6.1f} us"
              + errors(x, shape.weights[0], shape.scale, fusion, best), flush=True)
        if t_one * MARGIN < t_best:  # one term: the per-token-style FP8 activations that
            t_best, best = t_one, best._replace(x_terms=1)  # --quantization fp8 specifies
        if write:
            store_outcome(name, n, k, m, fusion.variant, best, t_best, t_base)
        torch.cuda.empty_cache()


def codes_sweep(rows: list[int], budget: float, write: bool) -> None:
    """The kernel on activations that arrive as e4m3 codes (RMSNorm and SiLU-mul emit them in
    DecoderLayer.forward_fp8_rows), plain products, over the grid (M = 16: M = 8's five best),
    against what the model runs now (the kernel quantising in registers where its entry says
    so; past 16 rows scaled_mm or the skinny kernel), and per_token_quant alone (the pass the
    producers fold in; fp8_weight_matmul runs it for 17-128 rows where the entry's margin
    covers it: o_proj). --write stores a winner
    2% or more ahead as the "codes" variant of the entry's "mma" key, for M >= 2 only (one row
    keeps the fused GEMV layer, which has no norm or SiLU kernel to carry the quantisation)."""
    from radixserve.layers.kernels.fp8_gemm import fp8_weight_matmul
    from radixserve.layers.kernels.fp8_mma_rows import MAX_ROWS, fp8_mma_rows
    from radixserve.layers.kernels.gemv import NO_FUSION
    from radixserve.layers.kernels.per_token_quant import per_token_quant
    ranked: dict[str, list] = {}
    for m, name, case_deadline in case_deadlines(rows, budget):
        n, k = SHAPES[name]
        shape = Shape("fp8", n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        codes, x_scale = per_token_quant(x, torch.float8_e4m3fn)
        if m <= MAX_ROWS:  # what the rows layer would run: maybe the in-register quantising
            t_base = shape.timed(lambda w: fp8_weight_matmul(x, w, shape.scale, None, None))
        else:  # scaled_mm or the skinny kernel (not this kernel's own codes path)
            t_base = shape.timed(lambda w: incumbent(x, w, shape.scale, NO_FUSION))
        t_quant = shape.timed(lambda w: per_token_quant(x, torch.float8_e4m3fn))
        grid = candidates(n, k) if m in FULL_SWEEP_ROWS or name not in ranked else \
            [config for _, config in ranked[name][:5]]
        results = time_grid(shape, grid, lambda w, c: fp8_mma_rows(
            codes, w, shape.scale, None, c, x_scale=x_scale, out_dtype=torch.bfloat16),
            case_deadline)
        if m == 8:
            ranked[name] = results
        if not results:
            print(f"   codes M={m:<2} {name:8s} no candidate timed (budget)", flush=True)
            continue
        t_best, best = results[0]
        print(f"   codes M={m:<2} {name:8s} now {t_base * 1e6:6.1f} us; codes kernel best "
              f"of {len(results)} {tuple(best)} {t_best * 1e6:6.1f} us "
              f"({shape.nbytes / t_best / 1e12:4.2f} TB/s); per_token_quant alone "
              f"{t_quant * 1e6:5.1f} us", flush=True)
        if write and m > 1:
            store_outcome(name, n, k, m, "codes", best._replace(x_terms=1), t_best, t_base)
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--budget", type=float, default=240.0, help="seconds in all")
    parser.add_argument("--write", action="store_true", help="store the winners")
    parser.add_argument("--codes", action="store_true",
                        help="instead: the kernel on activations quantised beforehand")
    parser.add_argument("--model-path", default=None,
                        help="a model directory with config.json (default: Llama-3.1-8B's)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="sweep the shapes one of this many ranks multiplies by")
    args = parser.parse_args()
    if args.model_path or args.tp_size > 1:
        use_model(args.model_path or DEFAULT_MODEL, args.tp_size)
    if not torch.cuda.is_available():
        print("gpu_fp8_mma: no CUDA device")
        return 0
    if args.codes:
        codes_sweep(args.rows, args.budget, args.write)
        return 0
    sweep(args.rows, args.budget, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
