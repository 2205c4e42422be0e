"""The routed experts at decode token counts: moe_gemv.py's two GEMVs against the grouped path.

  python benchmarks/gpu_moe_gemv.py --out DIR [--kinds bf16 fp8] [--write] [--time-budget 300]

For each expert shape (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V2-Lite; FP8: per-row codes) and
1 / 2 / 4 / 8 / 16 tokens: the grouped path (alignment + grouped GEMMs + SiLU-mul + sum, its
tuned block sizes) and each GEMV candidate for gate|up and down, all timed inside CUDA graphs
over four weight copies (no copy's experts stay in L2 between its calls), median of replays.
The best GEMV pair is checked against the per-expert torch loop and timed whole against the
grouped path. The table (T -> the pair with both times, or null where the grouped path won or
the GEMVs won by less than --margin) goes to
DIR/moe_configs/gemv_{kind}_E{e}_N{n}_K{k}.json; --write also puts it where this board reads
it (radixserve/layers/kernels/moe_configs/, boards/NAME/ off the reference board), so later
steps of the same call run with it. Lines: "gemv ..." per shape, count and kind.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.layers.kernels import board_tables  # noqa: E402
from radixserve.layers.kernels import fused_moe as fm  # noqa: E402
from radixserve.layers.kernels import moe_gemv as mg  # noqa: E402
from radixserve.layers.kernels.gemv import GemvConfig  # noqa: E402
from radixserve.layers.moe.router import RoutingConfig, select_experts  # noqa: E402

# name -> (experts, top_k, hidden, expert intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408),
          "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = (1, 2, 4, 8, 16)
COPIES = 4
# The sweep routes tokens uniformly at random, the GEMVs' best case: they read an expert once
# per token choosing it, the grouped path once. A model's routing repeats experts across tokens
# more (on the H100 Qwen3-30B-A3B decode at batch 16, 1.01x faster here, was 7% slower whole),
# so above one token the GEMVs take a count only where they win by this much.
MARGIN = 1.15
# (block_n, block_k, warps, stages, vec); FP8 doubles block_k (16-byte loads of codes)
GATE_UP = [(4, 256, 4, 3, 1), (8, 256, 4, 3, 1), (16, 256, 4, 3, 1), (8, 512, 4, 3, 1),
           (4, 512, 8, 3, 1), (2, 1024, 8, 2, 1), (8, 256, 4, 3, 8), (4, 512, 4, 3, 8),
           (16, 128, 4, 4, 1), (8, 128, 4, 4, 1),
           # wider and deeper (session 40): 16-byte loads over longer steps, more stages
           (2, 1024, 4, 3, 8), (4, 1024, 8, 3, 8), (8, 512, 8, 3, 8), (4, 512, 4, 4, 8),
           (2, 512, 4, 4, 8), (16, 256, 8, 3, 8)]
DOWN = [(2, 256, 4, 3, 1), (4, 256, 4, 3, 1), (8, 256, 4, 3, 1), (4, 128, 4, 4, 1),
        (8, 128, 4, 4, 1), (2, 512, 4, 3, 1), (4, 256, 4, 3, 8), (8, 128, 4, 3, 8),
        (16, 128, 4, 3, 1), (1, 512, 4, 3, 8),
        (2, 512, 4, 4, 8), (4, 512, 4, 3, 8), (1, 1024, 4, 3, 8), (2, 256, 2, 4, 8),
        (4, 256, 4, 4, 8), (1, 256, 1, 4, 8)]


def graph_time(fn, calls: int) -> float:
    """Seconds per fn() call: fn runs `calls` times in one CUDA graph, median of 15 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


class Problem:
    """COPIES weight sets of one expert shape (bf16, or FP8 codes with per-row scales) and a
    batch of routed tokens."""

    def __init__(self, shape: tuple[int, int, int, int], kind: str, num_tokens: int) -> None:
        num_experts, self.top_k, hidden, inter = shape
        gen = torch.Generator(device="cuda").manual_seed(num_tokens)
        self.sets = []
        for _ in range(COPIES):
            w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen,
                              dtype=torch.bfloat16) * 0.02
            w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen,
                             dtype=torch.bfloat16) * 0.02
            if kind == "fp8":
                self.sets.append(tuple(_per_row_fp8(w) for w in (w13, w2)))
            else:
                self.sets.append(((w13, None), (w2, None)))
        self.x = torch.randn(num_tokens, hidden, device="cuda", generator=gen,
                             dtype=torch.bfloat16)
        logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
        self.topk = select_experts(logits, RoutingConfig(num_experts, self.top_k,
                                                         renormalize=True))

    def scales(self, index: int):
        (_, s13), (_, s2) = self.sets[index]
        return None if s13 is None else (s13, s2, None)

    def grouped(self, index: int) -> torch.Tensor:
        (w13, _), (w2, _) = self.sets[index]
        return fm.fused_experts(self.x, w13, w2, self.topk.weights, self.topk.ids,
                                self.scales(index))

    def gemv(self, index: int, configs: mg.MoeGemvConfigs) -> torch.Tensor:
        (w13, _), (w2, _) = self.sets[index]
        return mg.moe_gemv_experts(self.x, w13, w2, self.topk.weights, self.topk.ids, configs,
                                   self.scales(index))

    def reference(self) -> torch.Tensor:
        (w13, s13), (w2, s2) = self.sets[0]
        if s13 is not None:
            w13, w2 = (w13.float() * s13).to(torch.bfloat16), (w2.float() * s2).to(torch.bfloat16)
        return fm.fused_experts_reference(self.x, w13, w2, self.topk.weights, self.topk.ids)


def _per_row_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / 448.0
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def _time_over_copies(call) -> float:
    return graph_time(lambda: [call(i) for i in range(COPIES)], 3) / COPIES


def _pick(problem: Problem, kind: str, hidden: int, inter: int, deadline: float
          ) -> tuple[mg.MoeGemvConfigs, float] | None:
    """The best gate|up candidate with the default down, then the best down with it."""
    double = 2 if kind == "fp8" else 1
    default = mg.default_configs(kind == "fp8")
    fitted_up, fitted_down = (mg.fit_block_k(default.gate_up, hidden, None),
                              mg.fit_block_k(default.down, inter, None))
    if fitted_up is None or fitted_down is None:
        return None
    best, best_s = mg.MoeGemvConfigs(fitted_up, fitted_down), None
    for which, candidates, k in (("gate_up", GATE_UP, hidden), ("down", DOWN, inter)):
        for bn, bk, warps, stages, vec in candidates:
            if time.time() > deadline:
                break
            fitted = mg.fit_block_k(GemvConfig(bn, bk * double, warps, stages, vec), k, None)
            if fitted is None:
                continue
            trial = best._replace(**{which: fitted})
            try:
                seconds = _time_over_copies(lambda i: problem.gemv(i, trial))
            except Exception as exc:  # out of registers / shared memory
                print(f"  skip {which} {fitted}: {type(exc).__name__}", flush=True)
                continue
            if best_s is None or seconds < best_s:
                best, best_s = trial, seconds
    return None if best_s is None else (best, best_s)


def table_entry(configs: mg.MoeGemvConfigs, gemv_s: float, grouped_s: float) -> dict:
    """A table's entry for a token count the GEMVs take, with both paths' times (us)."""
    return {"gate_up": configs.gate_up._asdict(), "down": configs.down._asdict(),
            "us": round(gemv_s * 1e6, 1), "grouped_us": round(grouped_s * 1e6, 1)}


def sweep(name: str, shape, kind: str, out: Path, write: bool, deadline: float,
          margin: float, lines: list[str]) -> None:
    num_experts, top_k, hidden, inter = shape
    table: dict[int, dict | None] = {}
    for num_tokens in TOKENS:
        if time.time() > deadline:
            break
        problem = Problem(shape, kind, num_tokens)
        mg.ENABLED = False
        grouped_s = _time_over_copies(problem.grouped)
        mg.ENABLED = True
        picked = _pick(problem, kind, hidden, inter, deadline)
        if picked is None:
            break
        configs, gemv_s = picked
        err = (problem.gemv(0, configs).float() - problem.reference()).abs().max().item()
        distinct = int(torch.unique(problem.topk.ids).numel())
        weight_bytes = distinct * 3 * hidden * inter * (1 if kind == "fp8" else 2)
        # one token's k experts are distinct: no routing repeats them, no margin
        wins = grouped_s >= (1.02 if num_tokens == 1 else margin) * gemv_s
        table[num_tokens] = table_entry(configs, gemv_s, grouped_s) if wins else None
        line = (f"gemv {name:<17} {kind} tokens {num_tokens:>2}: gemv {gemv_s * 1e6:7.1f} us "
                f"({weight_bytes / gemv_s / 1e12:4.2f} TB/s), grouped {grouped_s * 1e6:7.1f} us"
                f" ({weight_bytes / grouped_s / 1e12:4.2f}), {grouped_s / gemv_s:4.2f}x, "
                f"max err {err:.3g}; {'gemv' if wins else 'grouped'} {tuple(configs)}")
        print(line, flush=True)
        lines.append(line)
        del problem
        torch.cuda.empty_cache()
    if not table:
        return
    filename = mg.table_name(kind, num_experts, 2 * inter, hidden)
    folder = out / "moe_configs"
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps({str(t): entry for t, entry in table.items()}, indent=1) + "\n"
    (folder / filename).write_text(text)
    if write:  # over the board's own file: counts this sweep did not reach keep their entries
        path = board_tables.write_path(fm.CONFIG_DIR, filename, board_tables.current_board())
        path.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(path.read_text()) if path.is_file() else {}
        merged = {**old, **{str(t): entry for t, entry in table.items()}}
        path.write_text(json.dumps(dict(sorted(merged.items(), key=lambda kv: int(kv[0]))),
                                   indent=1) + "\n")
        print(f"  wrote {path}", flush=True)
    mg._swept_table.cache_clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/gpu_moe_gemv")
    parser.add_argument("--kinds", nargs="+", default=["bf16"], choices=["bf16", "fp8"])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--time-budget", type=float, default=300.0)
    parser.add_argument("--margin", type=float, default=MARGIN,
                        help="the GEMVs take a count where the grouped path is this much slower")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_moe_gemv: no CUDA device; nothing to run")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.time_budget
    lines: list[str] = []
    for kind in args.kinds:
        for name in args.models:
            sweep(name, SHAPES[name], kind, out, args.write, deadline, args.margin, lines)
    (out / "gpu_moe_gemv.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
