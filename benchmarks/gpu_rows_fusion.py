"""Small-batch decode's products through the GEMV widened to 2-8 rows, plain and with the
layer's fusions, on one GPU (written into that board's tables: kernels/board_tables.py).

    python3 benchmarks/gpu_rows_fusion.py [--rows 2 [4 8]] [--write] [--model-path DIR]
        [--vecs 1 8]

First each product without fusions: the GEMV widened to M rows (kernels/fused_rows.py; vec 1 and
8, --vecs) against what linear() would run there without it (cuBLAS or the skinny GEMM); --write
stores a winner 2% or more ahead under the M entry's "plain" key, which linear() then runs.
Then, per Llama-3.1-8B layer (bf16, tp 1; attention left out) and row count M: the chain the
model runs without fusions (RMSNorm with the residual add, q|k|v, o, RMSNorm with the residual
add, gate|up, SiLU-mul, down: seven kernels, the products on what linear() runs, the "plain"
winners included) against the fused chain of four (the norms in q|k|v and gate|up, SiLU-mul in
gate|up, the residual adds in o and down). Each fused product is first swept over a grid of
configurations (weights rotated through >= 600 MB), then both chains are captured in CUDA graphs
over rotating layer copies (every weight byte from HBM) and timed. --write stores the fused
winners in the kernels' tables (the M entry's "norm" / "norm+gated" / "residual" keys) where the
fused chain is 2% or more faster, and removes them where it is not: the model fuses a layer's
rows only where all four are written.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.model_shapes import DEFAULT_MODEL  # noqa: E402
from gpu_gemm_tune import MARGIN, Shape, time_graph  # noqa: E402
import gpu_row_fusion as one_row  # noqa: E402  (its SHAPES / HIDDEN / O_IN / INTER)

COPIES = 3
VECS = [1, 8]  # RowsConfig.vec values swept (--vecs)
VARIANTS = one_row.VARIANTS  # qkv: norm, o: residual, gate_up: norm+gated, down: residual


def candidates(rows: int, columns: int, k: int, gated: bool) -> list:
    """The grid swept per product and row count (columns: each half's when gated): tiles whose
    float32 accumulators take at most 64 registers per thread (more spill at 8 rows), that give
    each thread at least one vec of the tile and at least one program per SM (session 24's
    winners at 2 rows: 4 x 1024 and 8 x 512 tiles, 4 warps). With vec 8 (VECS) each row's
    accumulator is [block_n, block_k / 8], so wider tiles fit."""
    from radixserve.layers.kernels.fused_rows import RowsConfig
    grid = []
    for vec, bn, bk, warps in itertools.product(VECS, (2, 4, 8, 16), (512, 1024, 2048), (4, 8)):
        threads = 32 * warps
        accumulators = rows * bn * bk // vec * (2 if gated else 1)
        if (k % bk == 0 and accumulators <= 64 * threads and bn * bk >= vec * threads
                and columns // bn >= 132 and (vec > 1 or (bn <= 8 and bk <= 1024))):
            grid.append(RowsConfig(bn, bk, warps, 3, vec))
    return grid


def fusion_for(name: str, rows: int, norm: torch.Tensor, stream: torch.Tensor):
    from radixserve.layers.kernels.gemv import RowFusion
    if VARIANTS[name] == "residual":
        return RowFusion(residual=stream[:rows])
    return RowFusion(norm, 1e-5, gated=name == "gate_up")


def _compile_jobs(jobs: list[tuple]) -> int:
    """In a worker process: launch each (n, k, rows, variant, config) once, so that its
    binary lands in Triton's on-disk cache; configurations the GPU cannot run are skipped.
    Returns how many compiled."""
    from radixserve.layers.kernels.fused_rows import fused_rows
    from radixserve.layers.kernels.gemv import NO_FUSION, RowFusion
    hidden = torch.ones(max(k for _, k, *_ in jobs), device="cuda", dtype=torch.bfloat16)
    done = 0
    for n, k, rows, variant, config in jobs:
        w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.zeros(rows, k, device="cuda", dtype=torch.bfloat16)
        if not variant:
            fusion = NO_FUSION
        elif variant == "residual":  # never gated: the output has the weight's n columns
            fusion = RowFusion(residual=torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16))
        else:
            fusion = RowFusion(hidden[:k], 1e-5, gated=variant == "norm+gated")
        try:
            fused_rows(x, w, config, fusion)
            done += 1
        except Exception:  # out of registers / shared memory: the sweep times it as inf
            pass
    torch.cuda.synchronize()
    return done


def precompile(rows_list: list[int], workers: int = 12) -> None:
    """Every configuration the sweeps will time, compiled first by `workers` processes in
    parallel (one at a time, the 2-8-row kernels' compiles take longer than their timing)."""
    jobs = []
    for name, (n, k) in one_row.SHAPES.items():
        gated = name == "gate_up"
        for rows in rows_list:
            for cfg in candidates(rows, n, k, False):
                jobs.append((n, k, rows, "", cfg))
            for cfg in candidates(rows, n // 2 if gated else n, k, gated):
                jobs.append((n, k, rows, VARIANTS[name], cfg))
    workers = max(1, min(workers, (os.cpu_count() or 2) - 2, len(jobs)))
    start = time.monotonic()
    with concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        compiled = sum(pool.map(_compile_jobs, [jobs[i::workers] for i in range(workers)]))
    print(f"   precompiled {compiled} of {len(jobs)} configurations in {workers} processes, "
          f"{time.monotonic() - start:.0f} s", flush=True)


def sweep(rows_list: list[int]) -> dict[int, dict[str, tuple[float, object]]]:
    """rows -> product -> (seconds, best configuration)."""
    from radixserve.layers.kernels.fused_rows import fused_rows
    norm = 1 + 0.1 * torch.randn(one_row.HIDDEN, device="cuda", dtype=torch.bfloat16)
    stream = torch.randn(8, one_row.HIDDEN, device="cuda", dtype=torch.bfloat16)
    best: dict[int, dict[str, tuple[float, object]]] = {rows: {} for rows in rows_list}
    for name, (n, k) in one_row.SHAPES.items():
        shape = Shape("bf16", n, k)
        for rows in rows_list:
            gated = name == "gate_up"
            grid = candidates(rows, n // 2 if gated else n, k, gated)
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            fusion = fusion_for(name, rows, norm, stream)
            timed = sorted(((shape.timed(lambda w, c=cfg: fused_rows(x, w, c, fusion)), cfg)
                            for cfg in grid), key=lambda pair: pair[0])
            plain = shape.timed(lambda w: torch.nn.functional.linear(x, w))
            best[rows][name] = timed[0]
            print(f"   M={rows:<2} {name:8s} cuBLAS {plain * 1e6:6.1f} us; fused "
                  f"{VARIANTS[name]}: " + "; ".join(f"{tuple(c)} {t * 1e6:.1f}"
                                                    for t, c in timed[:3]), flush=True)
        del shape
        torch.cuda.empty_cache()
    return best


def unrowed_product(n: int, k: int, rows: int, x: torch.Tensor):
    """What `linear()` runs at M rows without a rows-GEMV entry: the skinny GEMM where the
    table's entry names a tile, else cuBLAS (the kernel a "plain" entry replaces)."""
    from radixserve.layers.kernels import gemm_tables, skinny_gemm
    cfg = skinny_gemm.config_from_entry(gemm_tables.tuned_entry("bf16", n, k, rows))
    if cfg is None:
        return lambda w: torch.nn.functional.linear(x, w)
    return lambda w: skinny_gemm.skinny_gemm(x, w, cfg)


def sweep_plain(rows_list: list[int], write: bool) -> None:
    """Each product without fusions through the GEMV widened to M rows against the kernel
    `linear()` runs there without it (cuBLAS or the skinny GEMM, per the tables; not against
    an earlier "plain" entry, which would then have to beat itself by the margin); with
    `write`, a winner 2% or more ahead goes into the M entry under "plain" (linear() then runs
    it), a stale one is removed."""
    from radixserve.layers import linear as linear_module
    from radixserve.layers.kernels import gemm_tables
    from radixserve.layers.kernels.fused_rows import PLAIN, fused_rows
    from radixserve.layers.kernels.gemv import NO_FUSION
    for name, (n, k) in one_row.SHAPES.items():
        shape = Shape("bf16", n, k)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            current = shape.timed(unrowed_product(n, k, rows, x))
            timed = sorted(((shape.timed(lambda w, c=cfg: fused_rows(x, w, c, NO_FUSION)), cfg)
                            for cfg in candidates(rows, n, k, False)),
                           key=lambda pair: pair[0])
            t_best, best = timed[0]
            wins = t_best * MARGIN < current
            print(f"   M={rows:<2} {name:8s} plain: skinny / cuBLAS {current * 1e6:6.1f} us; rows "
                  f"GEMV " + "; ".join(f"{tuple(c)} {t * 1e6:.1f}" for t, c in timed[:3])
                  + ("; written" if write and wins else ""), flush=True)
            if write:
                store(n, k, rows, PLAIN, dict(best._asdict(), us=round(t_best * 1e6, 2),
                                              base_us=round(current * 1e6, 2)) if wins else None)
        del shape
        torch.cuda.empty_cache()
    gemm_tables.clear_cache()
    linear_module._small_m_kernel.cache_clear()


class Layer(one_row.Layer):
    def rows_unfused(self, stream: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """What the model runs without the fusions (linear(): cuBLAS or the skinny GEMM)."""
        from radixserve.layers.kernels.rmsnorm import fused_rmsnorm
        from radixserve.layers.kernels.silu_and_mul import silu_and_mul
        from radixserve.layers.linear import linear
        normed, stream = fused_rmsnorm(hidden, self.norm1, 1e-5, stream)
        qkv = linear(normed, self.w["qkv"])
        o = linear(qkv[:, :one_row.O_IN].contiguous(), self.w["o"])
        normed, stream = fused_rmsnorm(o, self.norm2, 1e-5, stream)
        return linear(silu_and_mul(linear(normed, self.w["gate_up"])), self.w["down"])

    def rows_fused(self, stream: torch.Tensor, configs: dict[str, object]) -> torch.Tensor:
        from radixserve.layers.kernels.fused_rows import fused_rows
        from radixserve.layers.kernels.gemv import RowFusion
        qkv = fused_rows(stream, self.w["qkv"], configs["qkv"], RowFusion(self.norm1, 1e-5))
        stream = fused_rows(qkv[:, :one_row.O_IN].contiguous(), self.w["o"], configs["o"],
                            RowFusion(residual=stream))
        act = fused_rows(stream, self.w["gate_up"], configs["gate_up"],
                         RowFusion(self.norm2, 1e-5, gated=True))
        return fused_rows(act, self.w["down"], configs["down"], RowFusion(residual=stream))


def check(layer: Layer, rows: int, configs: dict[str, object]) -> float:
    """Largest difference of the fused chain's output from the layer computed in float32 from
    the same bf16 weights, relative to the largest output."""
    import torch.nn.functional as F
    stream = torch.randn(rows, one_row.HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = {name: weight.float() for name, weight in layer.w.items()}

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()

    s1 = stream.float()
    qkv = F.linear(rms(s1, layer.norm1), w["qkv"])
    s2 = s1 + F.linear(qkv[:, :one_row.O_IN], w["o"])
    gate, up = F.linear(rms(s2, layer.norm2), w["gate_up"]).chunk(2, dim=-1)
    want = s2 + F.linear(F.silu(gate) * up, w["down"])
    got = layer.rows_fused(stream, configs).float()
    return ((got - want).abs().max() / want.abs().max()).item()


def store(n: int, k: int, rows: int, key: str, value: dict | None) -> None:
    """Set (None: remove) `key` in the M = rows entry of the bf16 table of [n, k]; an entry
    left empty is removed, so that it does not shadow larger row counts."""
    from radixserve.layers.kernels import gemm_tables
    path = gemm_tables.writable_table("bf16", n, k)
    table = json.loads(path.read_text()) if path.is_file() else {}
    entry = table.setdefault(str(rows), {})
    entry.pop(key, None)
    if value is not None:
        entry[key] = value
    if not entry:
        del table[str(rows)]
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def write(rows: int, configs: dict[str, tuple[float, object]] | None) -> None:
    """The fused products' configurations into the M = rows entries (None: remove them)."""
    from radixserve.layers.kernels import gemm_tables
    for name, (n, k) in one_row.SHAPES.items():
        value = None
        if configs is not None:
            seconds, cfg = configs[name]
            value = dict(cfg._asdict(), us=round(seconds * 1e6, 2))
        store(n, k, rows, VARIANTS[name], value)
    gemm_tables.clear_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[2])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--model-path", default=str(DEFAULT_MODEL))
    parser.add_argument("--vecs", nargs="+", type=int, default=VECS,
                        help="per-thread sums swept (1: the plain tile; 8: one 16-byte load)")
    args = parser.parse_args()
    VECS[:] = args.vecs
    if not torch.cuda.is_available():
        print("gpu_rows_fusion: no CUDA device")
        return 0
    one_row.use_model(args.model_path)
    precompile(args.rows)
    sweep_plain(args.rows, args.write)  # first: the unfused layer below runs its winners
    best = sweep(args.rows)
    layers = [Layer("bf16") for _ in range(COPIES)]
    for rows in args.rows:
        configs = {name: cfg for name, (_, cfg) in best[rows].items()}
        stream = torch.randn(rows, one_row.HIDDEN, device="cuda", dtype=torch.bfloat16)
        hidden = torch.randn(rows, one_row.HIDDEN, device="cuda", dtype=torch.bfloat16)
        error = check(layers[0], rows, configs)
        t_unfused = time_graph(lambda: [layer.rows_unfused(stream, hidden)
                                        for layer in layers]) / COPIES
        t_fused = time_graph(lambda: [layer.rows_fused(stream, configs)
                                      for layer in layers]) / COPIES
        wins = t_fused * MARGIN < t_unfused
        print(f"== M={rows}: per layer unfused {t_unfused * 1e6:.1f} us, fused "
              f"{t_fused * 1e6:.1f} us (x 32: {t_unfused * 32e3:.3f} -> {t_fused * 32e3:.3f} "
              f"ms); fused differs by {error:.2e} of the largest output"
              + ("; written" if args.write and wins else ""), flush=True)
        if args.write:
            write(rows, best[rows] if wins else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
