"""The issue-5 figures on one GPU, in one process: Llama-3.1-8B shapes, bf16, dummy weights.

  python benchmarks/gpu_figures.py --out DIR [--time-budget 270] [--offline-prompts 1000]

The 8B model is loaded once, as a radixserve.Engine (CUDA graphs captured at startup), and that
Engine's ModelRunner serves every radixserve figure:
- decode ms/step at context 1024 for each --decode-batches size, graphs on (and off for
  --no-graph-batches), beside its roofline limit (hardware.py: bytes / 4.25 TB/s). The requests'
  1024 context tokens are KV slots allocated but not prefilled (they keep whatever they hold):
  the step reads them all the same, and a 256 x 1024 prefill would cost time and memory the
  figure does not need.
  The timed region is what one_batch.py times: prepare_decode + forward + sample + sync, and
  each graph size is timed again with the scheduler's overlap path (+overlap: each step is
  launched before the previous step's ids are read; ms/step is the run over its steps).
- prefill of 1 x 4096 and 8 x 1024 tokens (one_batch.run_one_batch), TFLOP/s vs 796;
- offline throughput, random 1024/1024 prompts (offline.run_offline) through the same Engine.
  When the measured decode/prefill rates predict more than --offline-seconds, fewer prompts
  are run (said in the table); the goal is 11,000 output tok/s.
Then the Engine is freed and transformers runs the same shapes (random init): batch-1 decode
ms/step after a 1024-token prompt, and batch 128 (plain generate, dynamic cache; the step time
is taken between consecutive logits-processor calls). Sections that would overrun
--time-budget are skipped and marked so; a section that raises is reported and the others still
run (exit status 1). DIR/figures.json and DIR/figures.txt are rewritten after every section, so
a run cut short keeps what it measured. Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from radixserve.bench import hardware  # noqa: E402
from radixserve.core.model_config import ModelConfig  # noqa: E402
from radixserve.core.req import Req  # noqa: E402
from radixserve.core.sampling_params import SamplingParams  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3.1-8b"
OFFLINE_GOAL_TOK_S = 11000.0
PREDICTION_MARGIN = 1.25  # scheduling overhead and eager steps above the largest graph


@dataclass
class Figure:
    name: str
    measured: float
    unit: str
    limit: float  # the hardware limit (or goal) in the same unit; nan when none
    ratio: float  # fraction of the limit achieved (limit/measured for times), nan when none
    note: str = ""


class Budget:
    def __init__(self, seconds: float) -> None:
        self.start, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- radixserve decode with a zero-filled context ----
def context_reqs(runner: Any, bs: int, context_len: int, seed: int) -> list[Req]:
    """`bs` requests that look prefilled: a row and `context_len` KV slots each (KV left as is),
    and one sampled token waiting to be decoded."""
    rows = runner.req_to_token_pool.alloc(bs)
    slots = runner.token_to_kv_pool.alloc(bs * context_len)
    if rows is None or slots is None:
        raise RuntimeError(f"no room for {bs} x {context_len} tokens")
    table = runner.req_to_token_pool.req_to_token
    table[torch.tensor(rows, device=table.device), :context_len] = \
        slots.view(bs, context_len).to(table.device, table.dtype)
    rng = np.random.default_rng(seed)
    vocab = runner.vocab_size
    low, high = min(1000, vocab // 4), min(30000, vocab)  # plain tokens, within any vocabulary
    reqs = []
    for i, row in enumerate(rows):
        params = SamplingParams(max_new_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        params.verify()
        params.normalize()
        req = Req(f"decode-{i}", rng.integers(low, high, size=context_len).tolist(), params)
        req.req_pool_idx, req.kv_len = row, context_len
        req.output_ids = [int(rng.integers(low, high))]
        reqs.append(req)
    return reqs


def free_reqs(runner: Any, reqs: list[Req]) -> None:
    table = runner.req_to_token_pool.req_to_token
    for req in reqs:
        runner.token_to_kv_pool.free(table[req.req_pool_idx, :req.kv_len].to("cpu", torch.int64))
        runner.req_to_token_pool.free(req.req_pool_idx)


def time_decode(runner: Any, bs: int, context_len: int, steps: int, warmup: int,
                peak: hardware.DevicePeak, overlap: bool = False) -> tuple[float, float]:
    """(median ms/step, mean limit ms/step) of `steps` timed decode steps after `warmup`;
    `overlap`: as the scheduler runs greedy decode (one_batch.timed_decode_steps)."""
    from radixserve.bench.one_batch import timed_decode_steps
    from radixserve.mem.chunk_cache import ChunkCache
    from radixserve.scheduler.batch import BatchBuilder
    cfg = runner.model_config
    builder = BatchBuilder(runner.req_to_token_pool, runner.token_to_kv_pool,
                           ChunkCache(runner.req_to_token_pool, runner.token_to_kv_pool),
                           runner.vocab_size, set(cfg.eos_token_ids), runner.device)
    reqs = context_reqs(runner, bs, context_len, seed=bs)
    try:
        timed_decode_steps(runner, builder, reqs, warmup, overlap=False)
        step_s = timed_decode_steps(runner, builder, reqs, steps, overlap)
    finally:
        free_reqs(runner, reqs)
    limits = [hardware.roofline(hardware.decode_step_bytes(cfg, bs, context_len + k + 1,
                                                           runner.dtype),
                                hardware.forward_flops(cfg, bs, context_len + k + 1), peak).seconds
              for k in range(warmup, warmup + steps)]
    return statistics.median(step_s) * 1e3, statistics.fmean(limits) * 1e3


def decode_figures(runner: Any, args: argparse.Namespace, peak: hardware.DevicePeak,
                   budget: Budget) -> tuple[list[Figure], dict[int, float]]:
    figures, ms_by_bs = [], {}
    graphs = runner.cuda_graph_runner
    runs = [(bs, True, overlap) for bs in args.decode_batches for overlap in (False, True)] + \
        [(bs, False, False) for bs in args.no_graph_batches]
    for bs, use_graphs, overlap in runs:
        if budget.left() < 30:
            figures.append(Figure(f"decode b{bs} {'graphs' if use_graphs else 'eager'}",
                                  float("nan"), "ms/step", float("nan"), float("nan"),
                                  "skipped: time budget"))
            continue
        runner.cuda_graph_runner = graphs if use_graphs else None
        try:
            ms, limit_ms = time_decode(runner, bs, args.context_len, args.decode_steps,
                                       args.decode_warmup, peak, overlap)
        finally:
            runner.cuda_graph_runner = graphs
        if use_graphs:
            ms_by_bs[bs] = min(ms, ms_by_bs.get(bs, ms))
        replayed = use_graphs and graphs is not None and bool(graphs.batch_sizes) \
            and bs <= graphs.batch_sizes[-1]
        mode = ("graphs" if replayed else "eager") + ("+overlap" if overlap else "")
        note = ""
        if bs == 1 and use_graphs:
            note = "goal <= 4.2 ms" + (" (as the scheduler decodes)" if overlap
                                       else " (synchronous steps)")
        figures.append(Figure(f"decode b{bs} ctx{args.context_len} {mode}", ms, "ms/step",
                              limit_ms, limit_ms / ms, note))
        print(f"  {figures[-1].name}: {ms:.3f} ms/step (limit {limit_ms:.3f})", flush=True)
    return figures, ms_by_bs


def prefill_figures(runner: Any, shapes: list[tuple[int, int]], peak: hardware.DevicePeak
                    ) -> tuple[list[Figure], float]:
    """TFLOP/s of each prefill shape (best of 2 after one warm-up); also the best tokens/s."""
    from radixserve.bench.one_batch import run_one_batch
    figures, best_tok_s = [], 0.0
    for bs, input_len in shapes:
        runs = [run_one_batch(runner, bs, input_len, 1, peak, seed=s) for s in range(3)]
        best = min(runs[1:], key=lambda r: r.prefill_ms)
        tflops = hardware.prefill_flops(runner.model_config, bs, input_len) / best.prefill_ms \
            / 1e9
        peak_tflops = peak.peak_flops / 1e12
        best_tok_s = max(best_tok_s, best.prefill_tok_s)
        figures.append(Figure(f"prefill {bs}x{input_len}", tflops, "TFLOP/s", peak_tflops,
                              tflops / peak_tflops,
                              f"{best.prefill_ms:.1f} ms; goal >= 60% of {peak_tflops:.0f}"))
        print(f"  {figures[-1].name}: {tflops:.1f} TFLOP/s ({best.prefill_ms:.1f} ms)", flush=True)
    return figures, best_tok_s


def offline_figure(engine: Any, args: argparse.Namespace, decode_ms: dict[int, float],
                   prefill_tok_s: float, budget: Budget,
                   peak: hardware.DevicePeak | None = None) -> Figure:
    from radixserve.bench.datasets import TokenSampler, sample_random_requests
    from radixserve.bench.offline import engine_vocab_size, run_offline
    n_in, n_out = args.offline_len
    seconds = min(args.offline_seconds, budget.left() - args.hf_reserve)
    # predicted time per prompt: its prefill, plus its decode at the largest measured batch rate
    big_bs = max(decode_ms) if decode_ms else 1
    decode_tok_s = big_bs / (decode_ms.get(big_bs, 50.0) / 1e3)
    per_prompt_s = PREDICTION_MARGIN * (n_in / max(prefill_tok_s, 1.0) + n_out / decode_tok_s)
    num = args.offline_prompts
    note = f"{num} prompts"
    if num * per_prompt_s > seconds:
        num = max(16, int(seconds / per_prompt_s) // 16 * 16)
        note = (f"{num} of {args.offline_prompts} prompts: {args.offline_prompts} predicted "
                f"{args.offline_prompts * per_prompt_s:.0f} s > {seconds:.0f} s")
    if seconds < 10:
        return Figure("offline out tok/s", float("nan"), "tok/s", OFFLINE_GOAL_TOK_S,
                      float("nan"), "skipped: time budget")
    requests = sample_random_requests(num, n_in, n_out, 1.0, seed=1,
                                      token_sampler=TokenSampler(None, engine_vocab_size(engine)))
    # the scheduler's INFO lines (one per prefill batch, every few decode steps) go to a file
    sched_logger = logging.getLogger("radixserve.scheduler")
    handler = None
    if args.out:
        handler = logging.FileHandler(Path(args.out) / "offline_scheduler.log", mode="w")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        sched_logger.addHandler(handler)
        previous_level = sched_logger.level
        sched_logger.setLevel(logging.INFO)
    try:
        result = run_offline(engine, requests, radix_cache=True, peak=peak)
    finally:
        if handler is not None:
            sched_logger.removeHandler(handler)
            sched_logger.setLevel(previous_level)
            handler.close()
    note += (f", {result.duration_s:.1f} s, {result.output_len_mismatches} length mismatches, "
             f"goal {OFFLINE_GOAL_TOK_S:.0f} tok/s = "
             f"{OFFLINE_GOAL_TOK_S * result.limit_s / (n_out * len(requests)):.1%} of the limit")
    print(f"  offline: {result.output_throughput:.0f} out tok/s ({note})", flush=True)
    limit_tok_s = result.total_output_tokens / result.limit_s
    return Figure(f"offline {n_in}/{n_out} out tok/s", result.output_throughput, "tok/s",
                  limit_tok_s, result.output_throughput / limit_tok_s,
                  note + " (limit: FLOPs/peak + decode KV bytes/bandwidth)")


# ---- transformers on the same shapes ----
class StepTimer:
    """A logits processor that stamps the time (after a device sync) at every generated token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync()
        self.stamps.append(time.perf_counter())
        return scores

    def median_step_ms(self) -> float:
        gaps = np.diff(self.stamps)  # the first stamp follows the prefill
        return float(np.median(gaps)) * 1e3 if len(gaps) else float("nan")


def hf_decode_ms(model: Any, bs: int, context_len: int, new_tokens: int, vocab: int) -> float:
    import transformers
    ids = torch.randint(1000, min(30000, vocab), (bs, context_len), device=model.device)
    timer = StepTimer()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens,
                                           min_new_tokens=new_tokens, eos_token_id=None,
                                           pad_token_id=0, bos_token_id=None)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                       logits_processor=transformers.LogitsProcessorList([timer]))
    return timer.median_step_ms()


def hf_figures(model_path: str, args: argparse.Namespace, cfg: Any, peak: hardware.DevicePeak,
               budget: Budget) -> list[Figure]:
    import transformers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = transformers.AutoConfig.from_pretrained(model_path)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    figures = []
    hf_decode_ms(model, 1, 16, 3, cfg.vocab_size)  # warm-up
    for bs, new_tokens in ((1, args.hf_steps), (args.hf_batch, max(4, args.hf_steps // 2))):
        if budget.left() < 20 and bs > 1:
            figures.append(Figure(f"HF decode b{bs}", float("nan"), "ms/step", float("nan"),
                                  float("nan"), "skipped: time budget"))
            continue
        try:
            ms = hf_decode_ms(model, bs, args.context_len, new_tokens, cfg.vocab_size)
        except torch.OutOfMemoryError:
            figures.append(Figure(f"HF decode b{bs}", float("nan"), "ms/step", float("nan"),
                                  float("nan"), "out of memory"))
            continue
        ctx = args.context_len + new_tokens / 2
        limit_ms = hardware.roofline(hardware.decode_step_bytes(cfg, bs, ctx, torch.bfloat16),
                                     hardware.forward_flops(cfg, bs, ctx), peak).seconds * 1e3
        figures.append(Figure(f"HF decode b{bs} ctx{args.context_len}", ms, "ms/step", limit_ms,
                              limit_ms / ms, f"transformers {transformers.__version__}"))
        print(f"  {figures[-1].name}: {ms:.2f} ms/step (limit {limit_ms:.3f})", flush=True)
    del model
    gc.collect()
    return figures


# ---- report ----
def save(out: str | None, peak: hardware.DevicePeak, figures: list[Figure]) -> None:
    """Written after every section, so a run cut short still leaves what it measured."""
    if not out:
        return
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "figures.txt").write_text(format_table(figures) + "\n")
    (folder / "figures.json").write_text(json.dumps(
        {"device": peak.name, "peak": asdict(peak), "figures": [asdict(f) for f in figures]},
        indent=1))


def format_table(figures: list[Figure]) -> str:
    lines = [f"{'figure':<32} | {'measured':>18} | {'limit':>18} | {'ratio':>6} | note"]
    for f in figures:
        measured = "n/a" if f.measured != f.measured else f"{f.measured:.3f} {f.unit}"
        limit = "n/a" if f.limit != f.limit else f"{f.limit:.3f} {f.unit}"
        ratio = "n/a" if f.ratio != f.ratio else f"{100 * f.ratio:.1f}%"
        lines.append(f"{f.name:<32} | {measured:>18} | {limit:>18} | {ratio:>6} | {f.note}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--model-path", default=str(DEFAULT_CONFIG), help="a folder with config.json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--time-budget", type=float, default=270.0, help="seconds for everything")
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--no-graph-batches", type=int, nargs="*", default=[1, 32])
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--decode-warmup", type=int, default=3)
    p.add_argument("--prefill", nargs="+", default=["1x4096", "8x1024"], help="BATCHxLEN")
    p.add_argument("--offline-prompts", type=int, default=1000)
    p.add_argument("--offline-len", type=int, nargs=2, default=[1024, 1024], metavar=("IN", "OUT"))
    p.add_argument("--offline-seconds", type=float, default=150.0,
                   help="run fewer prompts when the prediction exceeds this")
    p.add_argument("--hf-batch", type=int, default=128)
    p.add_argument("--hf-steps", type=int, default=24)
    p.add_argument("--hf-reserve", type=float, default=45.0, help="seconds kept for transformers")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="default: the engine's (512 on GPUs over 100 GB, else 256)")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU (small shapes only)")
    return p


T = TypeVar("T")


def start_engine(args: argparse.Namespace, max_context: int) -> Any:
    """The Engine for every radixserve figure. Works around one known startup failure: a
    ModelRunner that profiles its prefill (no --max-total-tokens) before it has set
    `cuda_graph_runner` raises AttributeError; then the KV pool is sized without the profile
    (mem fraction 0.85 instead of 0.88 minus the measured activations)."""
    from radixserve.engine import Engine
    kwargs: dict[str, Any] = dict(model_path=args.model_path, load_format="dummy",
                                  dtype=args.dtype, context_length=max_context,
                                  skip_tokenizer_init=True,
                                  cuda_graph_max_bs=args.cuda_graph_max_bs)
    try:
        return Engine(max_total_tokens=args.max_total_tokens, **kwargs)
    except AttributeError as exc:
        if "cuda_graph_runner" not in str(exc) or args.max_total_tokens is not None:
            raise
        print(f"warning: engine startup failed ({exc}): ModelRunner profiles the prefill "
              f"before it sets cuda_graph_runner; retrying with --mem-fraction-static 0.85 "
              f"and no profile", flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return Engine(max_total_tokens=1 << 40, mem_fraction_static=0.85, **kwargs)


def guarded(failed: list[str], section: str, fn: Callable[[], T], fallback: T) -> T:
    """Run one section; if it raises, print the error, note it in `failed` and go on."""
    try:
        return fn()
    except Exception:  # one broken section must not cost the others' figures
        print(f"gpu_figures: section {section} failed:\n{traceback.format_exc()}", flush=True)
        failed.append(section)
        return fallback


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_figures: no CUDA device; skipped (use --allow-cpu with small shapes to check "
              "the script on the CPU)")
        return 0
    budget = Budget(args.time_budget)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("radixserve.scheduler").setLevel(logging.WARNING)  # one line per batch
    max_context = max(args.context_len + args.decode_warmup + args.decode_steps + 8,
                      *(int(s.split("x")[1]) + 8 for s in args.prefill),
                      sum(args.offline_len) + 8)
    start = time.perf_counter()
    engine = start_engine(args, max_context)
    runner = engine.scheduler.runner
    startup_s = time.perf_counter() - start
    peak = hardware.device_peak(runner.device, runner.dtype)
    graphs = runner.cuda_graph_runner
    sizes = graphs.batch_sizes if graphs is not None else []
    print(f"engine up in {startup_s:.1f} s: {runner.max_total_num_tokens} KV tokens, "
          f"{runner.max_num_reqs} request slots, graphs for {len(sizes)} batch sizes "
          f"(max {sizes[-1] if sizes else 0}); {peak.name} ({peak.source})", flush=True)
    figures = [Figure("engine startup (load+graphs)", startup_s, "s", float("nan"), float("nan"),
                      f"{len(sizes)} graphs")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.prefill]
    failed: list[str] = []
    # prefill first: it also warms up the kernels
    prefill, prefill_tok_s = guarded(failed, "prefill", lambda: prefill_figures(runner, shapes, peak),
                                     ([], 20000.0))
    save(args.out, peak, figures + prefill)
    decode, decode_ms = guarded(failed, "decode", lambda: decode_figures(runner, args, peak, budget),
                                ([], {}))
    figures += decode + prefill
    save(args.out, peak, figures)
    figures += guarded(failed, "offline", lambda: [offline_figure(
        engine, args, decode_ms, prefill_tok_s, budget, peak)], [])
    save(args.out, peak, figures)
    engine.shutdown()
    engine = runner = graphs = None  # free the 8B model and its KV cache before transformers
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"radixserve freed: {torch.cuda.memory_allocated() / 2**30:.1f} GiB still "
              f"allocated", flush=True)
    if not args.skip_hf:
        if budget.left() > 15:
            figures += guarded(failed, "HF", lambda: hf_figures(
                args.model_path, args, ModelConfig.from_path(args.model_path), peak, budget), [])
        else:
            figures.append(Figure("HF decode", float("nan"), "ms/step", float("nan"),
                                  float("nan"), "skipped: time budget"))
    print(format_table(figures))
    save(args.out, peak, figures)
    if failed:
        print(f"gpu_figures: failed sections: {', '.join(failed)} (see above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
