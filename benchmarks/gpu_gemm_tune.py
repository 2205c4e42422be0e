"""Sweep the decode-sized weight products on the H200 and write the tables the kernels read
(radixserve/layers/kernels/gemm_configs/{bf16,fp8}_N{n}_K{k}.json, see kernels/gemm_tables.py).

    python3 benchmarks/gpu_gemm_tune.py [--kinds bf16 fp8] [--budget 300] [--write-dir DIR]
        [--model-path benchmarks/configs/llama-3.1-70b --tp-size 8]

Per decode product of the model (qkv, o, gate_up, down, lm_head; Llama-3.1-8B by default) on
one of --tp-size ranks (benchmarks/model_shapes.py), and row count M:
  M = 1:       the GEMV over (block_n, block_k, warps, stages): FP8 always, bf16 with
               --gemv-bf16 (without it, bf16 keeps its shape-class defaults, which
               benchmarks/gpu_tune.py swept for Llama-3.1-8B's shapes);
  M = 8, 32:   the skinny tile GEMM over (SWAP_AB, BLOCK_N, BLOCK_K, SPLIT_K, stages) against cuBLAS
               (bf16) or torch._scaled_mm with per-token activation scales (fp8, per-channel);
  M = 2, 4, 16, 64: the five best configurations of the nearest full sweep, and the baseline.
Each candidate is timed as the caller runs it (allocation, zeroing and the cast back of split K
included) in a CUDA graph over rotating weight copies, so every read comes from HBM. An entry
records the winner, its time ("us") and the baseline's ("base_us"); where the vendor kernel
won, the best tile as well ("triton", "triton_us": see skinny_gemm.VENDOR_GAP_US).
--in-chain times each candidate between two short PDL kernels instead of alone, so a vendor
kernel pays the launch it delays (session 25: at batch 8 a tile 0.5 us faster alone took the
decode step 0.12 ms lower).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_shapes import DEFAULT_MODEL, decode_product_shapes  # noqa: E402

SHAPES = decode_product_shapes()  # Llama-3.1-8B; --model-path / --tp-size for others
FULL_SWEEP_M = {2: 8, 4: 8, 8: 8, 16: 8, 32: 32, 64: 32}  # M -> the M whose sweep it reuses
ORDER = (8, 32, 2, 4, 16, 64)
MARGIN = 1.02
COPY_BYTES = 600 << 20  # rotating copies together exceed the 60 MB L2 cache many times


def time_graph(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=10) * 1e-3


def pdl_neighbour(rows: int = 8, hidden: int = 4096) -> Callable[[], object]:
    """A short Triton kernel launched with programmatic dependent launch (RMSNorm over a few
    rows), as the kernels around a decode product are: timed around a product, it shows what
    the product costs its neighbours (a vendor kernel lets the next one launch only once it has
    finished), which a product timed alone does not."""
    from radixserve.layers.kernels.rmsnorm import fused_rmsnorm
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    return lambda: fused_rmsnorm(x, weight, 1e-5)


class Shape:
    def __init__(self, kind: str, n: int, k: int, in_chain: bool = False) -> None:
        """in_chain: time each product between two PDL neighbours (`pdl_neighbour`), less the
        neighbours' own time back to back."""
        self.kind, self.n, self.k = kind, n, k
        nbytes = n * k * (1 if kind == "fp8" else 2)
        self.copies = max(2, -(-COPY_BYTES // nbytes))
        self.nbytes = nbytes
        if kind == "fp8":
            self.weights = [torch.randint(-100, 100, (n, k), device="cuda", dtype=torch.int16)
                            .to(torch.float8_e4m3fn) for _ in range(self.copies)]
            self.scale = torch.rand(n, 1, device="cuda") * 1e-3
        else:
            self.weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                            for _ in range(self.copies)]
            self.scale = None
        self.neighbour = pdl_neighbour() if in_chain else None
        self.neighbours_alone = 0.0
        if self.neighbour is not None:
            pair = self.neighbour
            self.neighbours_alone = time_graph(
                lambda: [(pair(), pair()) for _ in self.weights]) / self.copies

    def timed(self, product: Callable[[torch.Tensor], object]) -> float:
        pair = self.neighbour
        if pair is None:
            body = lambda: [product(w) for w in self.weights]  # noqa: E731
        else:
            body = lambda: [(pair(), product(w), pair()) for w in self.weights]  # noqa: E731
        try:
            return time_graph(body) / self.copies - self.neighbours_alone
        except Exception:  # out of shared memory / registers for this configuration
            return float("inf")


def gemv_candidates(kind: str):
    """The one-row GEMV grid; FP8 also with each thread's 16 codes summed before they are
    accumulated (GemvConfig.vec 16: fewer registers, more programs per SM; session 32)."""
    from radixserve.layers.kernels.gemv import GemvConfig
    vecs = (16, 1) if kind == "fp8" else (1,)
    for vec, bn, bk, warps, stages in itertools.product(vecs, (2, 4, 8, 16), (512, 1024, 2048),
                                                        (4, 8), (2, 3, 4)):
        yield GemvConfig(bn, bk, warps, stages, vec)


def tile_candidates(m: int, k: int):
    for swap, bn, bk, split, stages in itertools.product((0, 1), (16, 32, 64, 128), (128, 256),
                                                         (1, 2, 4, 8), (3, 4)):
        if k // split < 2 * bk or (bn == 128 and not swap) or (bn == 16 and swap):
            continue
        yield dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                   SWAP_AB=swap, num_warps=4, num_stages=stages)


def sweep_gemv(shape: Shape) -> dict:
    from radixserve.layers.kernels.gemv import fp8_gemv, gemv
    x = torch.randn(1, shape.k, device="cuda", dtype=torch.bfloat16)
    best = (float("inf"), None)
    for cfg in gemv_candidates(shape.kind):
        if shape.k % cfg.block_k:
            continue
        if shape.kind == "fp8":
            product = lambda w, cfg=cfg: fp8_gemv(x, w, shape.scale, None, config=cfg)  # noqa
        else:
            product = lambda w, cfg=cfg: gemv(x, w, config=cfg)  # noqa: E731
        seconds = shape.timed(product)
        best = min(best, (seconds, cfg), key=lambda pair: pair[0])
    seconds, cfg = best
    return dict(cfg._asdict(), us=round(seconds * 1e6, 2))


def baseline(shape: Shape, m: int) -> float:
    x = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16)
    if shape.kind == "bf16":
        return shape.timed(lambda w: torch.nn.functional.linear(x, w))
    from radixserve.layers.kernels.fp8_gemm import scaled_mm_per_token
    return shape.timed(lambda w: scaled_mm_per_token(x, w, shape.scale, None))


def sweep_tiles(shape: Shape, m: int, candidates: list[dict]) -> list[tuple[float, dict]]:
    from radixserve.layers.kernels.skinny_gemm import skinny_gemm
    x = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16)
    timed = []
    for cfg in candidates:
        timed.append((shape.timed(lambda w, cfg=cfg: skinny_gemm(x, w, cfg, shape.scale)), cfg))
    return sorted(timed, key=lambda pair: pair[0])


def tune_shape(shape: Shape, deadline: float, gemv: bool) -> dict[str, dict]:
    """gemv: sweep the M = 1 GEMV too."""
    table: dict[str, dict] = {}
    if gemv:
        entry = sweep_gemv(shape)
        table["1"] = entry
        print(f"  M=1  gemv {entry}  {shape.nbytes / entry['us'] / 1e6:5.2f} TB/s", flush=True)
    ranked: dict[int, list[tuple[float, dict]]] = {}
    for m in ORDER:
        if time.time() > deadline:
            print("  budget spent", flush=True)
            break
        source = FULL_SWEEP_M[m]
        candidates = list(tile_candidates(m, shape.k)) if source not in ranked else \
            [dict(cfg, BLOCK_M=16 if m <= 16 else 32) for _, cfg in ranked[source][:5]]
        timed = sweep_tiles(shape, m, candidates)
        if source == m:
            ranked[m] = timed
        base = baseline(shape, m)
        seconds, cfg = timed[0]
        base_name = "cublas" if shape.kind == "bf16" else "scaled_mm"
        if seconds * MARGIN > base:  # the vendor kernel unless ours is 2% faster or more
            entry = {"kernel": base_name, "us": round(base * 1e6, 2),
                     "triton_us": round(seconds * 1e6, 2), "triton": cfg}
        else:
            entry = dict(cfg, us=round(seconds * 1e6, 2), base_us=round(base * 1e6, 2))
        table[str(m)] = entry
        print(f"  M={m:<3} {entry}  triton {shape.nbytes / seconds / 1e12:5.2f} TB/s, "
              f"{base_name} {shape.nbytes / base / 1e12:5.2f} TB/s", flush=True)
    return table


# what other sweeps store inside an entry: the one-row fusions' configurations
# (gpu_row_fusion.py), the rows GEMV's plain and fused ones at 2-8 rows (gpu_rows_fusion.py)
# and the FP8 tensor-core kernel's (gpu_fp8_mma.py)
OTHER_SWEEPS_KEYS = ("norm", "norm+gated", "residual", "plain", "mma")


def merged(old: dict[str, dict], new: dict[str, dict]) -> dict[str, dict]:
    """The table with this sweep's entries replacing the old ones, keeping what the other
    sweeps wrote inside them."""
    table = dict(old)
    for m, entry in new.items():
        kept = {key: value for key, value in old.get(m, {}).items() if key in OTHER_SWEEPS_KEYS}
        table[m] = {**kept, **entry}
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["fp8", "bf16"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--model-path", default=None,
                        help="a model directory with config.json (default: Llama-3.1-8B's)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="sweep the shapes one of this many ranks multiplies by")
    parser.add_argument("--gemv-bf16", action="store_true",
                        help="sweep the bf16 GEMV at M = 1 too (shapes other than "
                             "Llama-3.1-8B's tp 1 have no swept bf16 GEMV configuration)")
    parser.add_argument("--budget", type=float, default=300.0)
    parser.add_argument("--write-dir", default=None,
                        help="default: this board's tables in the package's gemm_configs "
                             "(kernels/gemm_tables.py: the H200's own files, boards/NAME/ "
                             "for others)")
    parser.add_argument("--no-gemv", action="store_true",
                        help="keep the tables' M = 1 entries (sweep the tiles only)")
    parser.add_argument("--in-chain", action="store_true",
                        help="time each product between two PDL kernels (what it costs its "
                             "neighbours too; entries are marked \"timed\": \"in chain\")")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_gemm_tune: no CUDA device")
        return 0
    from radixserve.layers.kernels import gemm_tables
    out_dir = Path(args.write_dir) if args.write_dir else None  # None: this board's tables
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    shapes = decode_product_shapes(args.model_path or DEFAULT_MODEL, args.tp_size)
    deadline = time.time() + args.budget
    for kind in args.kinds:
        for name in args.shapes:
            if time.time() > deadline:
                print("budget spent")
                return 0
            n, k = shapes[name]
            print(f"== {kind} {name} N={n} K={k}", flush=True)
            shape = Shape(kind, n, k, in_chain=args.in_chain)
            table = tune_shape(shape, deadline, gemv=not args.no_gemv
                               and (kind == "fp8" or args.gemv_bf16))
            if args.in_chain:
                for entry in table.values():
                    entry["timed"] = "in chain"
            del shape
            torch.cuda.empty_cache()
            path = (out_dir / f"{kind}_N{n}_K{k}.json" if out_dir is not None
                    else gemm_tables.writable_table(kind, n, k))
            old = json.loads(path.read_text()) if path.is_file() else {}
            path.write_text(json.dumps(merged(old, table), indent=1, sort_keys=True) + "\n")
    gemm_tables.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
