"""One static batch straight through the ModelRunner, no scheduler: prefill, then decode steps.

`radixserve bench one-batch --batch-size 1 16 --input-len 128 --output-len 32` (server flags
such as --model-path, --load-format dummy, --dtype are accepted too). For each batch size it
prints the prefill time and tokens/s and the decode time per step, each beside its roofline
limit (hardware.py: max(bytes / bandwidth, FLOPs / peak)) and the ratio limit / measured, the
fraction of the hardware's limit the step achieved (1.0 would be perfect).

Batches are built by the scheduler's own BatchBuilder from real Reqs, so per-step host work
(slot allocation, sampling tensors) is timed as the server pays it; the timed region of a step
is prepare + forward + sample, ending with a device sync. With --overlap, decode runs as the
scheduler runs it by default: each step launched before the previous step's ids are read (the
host work of a step hides behind the GPU work of the one before); ms/step is then the decode
run's time over its steps. The prompts are prefilled in passes of at most --max-prefill-tokens
tokens (whole requests, 16,384 by default, as the scheduler bounds a prefill batch); the prefill
time is the passes' sum.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from radixserve.bench import hardware
from radixserve.bench.cli_support import BenchError, int_at_least, output_file, run_command
from radixserve.bench.datasets import TokenSampler
from radixserve.bench.metrics import json_number
from radixserve.config import ServerArgs
from radixserve.core.server_flags import OFFLINE_GROUPS
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams


@dataclass
class OneBatchResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_ms: float
    prefill_tok_s: float
    prefill_limit_ms: float
    prefill_ratio: float
    prefill_bound: str
    decode_ms_per_step: float  # median over the decode steps
    decode_tok_s: float
    decode_limit_ms: float  # the mean of the per-step limits
    decode_ratio: float
    decode_bound: str
    output_ids_ok: bool  # every request got exactly output_len tokens
    output_ids: list[list[int]] = field(default_factory=list, repr=False)  # not in JSON


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """The random prompts run_one_batch uses for these arguments."""
    sampler = TokenSampler(None, vocab_size)
    rng = np.random.default_rng(seed)
    return [sampler.sample(rng, input_len) for _ in range(batch_size)]


def _make_reqs(batch_size: int, input_len: int, output_len: int, vocab_size: int,
               seed: int) -> list[Req]:
    reqs = []
    for i, prompt in enumerate(make_prompts(batch_size, input_len, vocab_size, seed)):
        params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        params.verify()
        params.normalize()
        req = Req(f"one-batch-{i}", prompt, params)
        req.fill_ids = list(req.origin_input_ids)
        req.extend_input_len = input_len
        reqs.append(req)
    return reqs


def prefill_passes(reqs: list[Req], max_tokens: int | None) -> list[list[Req]]:
    """The prompts in passes of whole requests of at most `max_tokens` tokens each (a pass
    takes at least one request), as the scheduler bounds a prefill batch; None: one pass."""
    if max_tokens is None:
        return [reqs]
    passes: list[list[Req]] = []
    tokens = 0
    for req in reqs:
        if not passes or tokens + req.extend_input_len > max_tokens:
            passes.append([])
            tokens = 0
        passes[-1].append(req)
        tokens += req.extend_input_len
    return passes


def run_one_batch(runner: Any, batch_size: int, input_len: int, output_len: int,
                  peak: hardware.DevicePeak, seed: int = 0, overlap: bool = False,
                  max_prefill_tokens: int | None = None) -> OneBatchResult:
    """Prefill `batch_size` random prompts of `input_len` tokens, then decode until each has
    `output_len` tokens (the first comes from prefill). Frees every slot it takes. `overlap`
    times decode as the scheduler's overlap path runs it (see timed_decode_steps).
    `max_prefill_tokens`: the prefill runs in passes of at most that many tokens (whole
    requests; the prefill time is their sum), so a large batch does not need the activations
    of one pass over all its prompts; None: one pass."""
    from radixserve.mem.chunk_cache import ChunkCache
    from radixserve.scheduler.batch import BatchBuilder

    cfg, device, dtype = runner.model_config, runner.device, runner.dtype
    builder = BatchBuilder(runner.req_to_token_pool, runner.token_to_kv_pool,
                           ChunkCache(runner.req_to_token_pool, runner.token_to_kv_pool),
                           runner.vocab_size, set(cfg.eos_token_ids), device)
    reqs = _make_reqs(batch_size, input_len, output_len, cfg.vocab_size, seed)
    try:
        _sync(device)
        start = time.perf_counter()
        passes = [(group, runner.forward(builder.prepare_extend(group)))
                  for group in prefill_passes(reqs, max_prefill_tokens)]
        _sync(device)
        prefill_s = time.perf_counter() - start
        for group, out in passes:
            for req, token in zip(group, out.next_token_ids):
                req.output_ids.append(int(token))
        step_s = timed_decode_steps(runner, builder, reqs, output_len - 1, overlap)
    finally:
        _free(runner, reqs)

    pre = hardware.roofline(hardware.prefill_bytes(cfg, batch_size, input_len, dtype),
                            hardware.prefill_flops(cfg, batch_size, input_len), peak)
    # decode step k writes position input_len + k, so each sequence attends to input_len + k + 1
    linear_dtype: torch.dtype | float | None = None
    if getattr(runner, "fp8", None) is not None:
        linear_dtype = torch.float8_e4m3fn
    elif getattr(runner, "int4", None) is not None:
        linear_dtype = runner.int4.bytes_per_weight(hardware.dtype_bytes(dtype))
    kv_dtype = runner.kv_cache_spec.storage_dtype
    limits = [hardware.roofline(hardware.decode_step_bytes(cfg, batch_size, input_len + k + 1,
                                                           dtype, linear_dtype, kv_dtype),
                                hardware.forward_flops(cfg, batch_size, input_len + k + 1), peak)
              for k in range(output_len - 1)]
    decode_s = statistics.median(step_s) if step_s else float("nan")
    decode_limit = statistics.fmean(l.seconds for l in limits) if limits else float("nan")
    bounds = [l.bound for l in limits]
    return OneBatchResult(
        batch_size=batch_size, input_len=input_len, output_len=output_len,
        prefill_ms=prefill_s * 1e3, prefill_tok_s=batch_size * input_len / prefill_s,
        prefill_limit_ms=pre.seconds * 1e3, prefill_ratio=pre.seconds / prefill_s,
        prefill_bound=pre.bound,
        decode_ms_per_step=decode_s * 1e3, decode_tok_s=batch_size / decode_s,
        decode_limit_ms=decode_limit * 1e3, decode_ratio=decode_limit / decode_s,
        decode_bound=max(set(bounds), key=bounds.count) if bounds else "n/a",
        output_ids_ok=all(len(r.output_ids) == output_len for r in reqs),
        output_ids=[list(r.output_ids) for r in reqs])


def timed_decode_steps(runner: Any, builder: Any, reqs: list[Req], steps: int,
                       overlap: bool) -> list[float]:
    """Run `steps` decode steps of `reqs`, appending their tokens; seconds per step.

    Synchronous: each step is prepare + forward + sample + sync, timed alone. Overlap (as the
    scheduler runs greedy batches): step k+1 is launched before step k's ids are read, so a
    step's time is the whole run's over `steps`, the same figure for each."""
    device = runner.device
    if not overlap:
        step_s = []
        for _ in range(steps):
            start = time.perf_counter()
            out = runner.forward(builder.prepare_decode(reqs))
            _sync(device)
            step_s.append(time.perf_counter() - start)
            for req, token in zip(reqs, out.next_token_ids):
                req.output_ids.append(int(token))
        return step_s
    _sync(device)
    start = time.perf_counter()
    inflight = None
    for step in range(steps + 1):
        launched = runner.forward_decode_async(
            builder.prepare_decode(reqs), None if inflight is None else inflight.ids) \
            if step < steps else None
        if inflight is not None:
            for req, token in zip(reqs, inflight.token_ids()):
                req.output_ids.append(int(token))
        inflight = launched
    _sync(device)
    return [(time.perf_counter() - start) / steps] * steps if steps else []


def why_batches_do_not_fit(runner: Any, batch_size: int, input_len: int,
                           output_len: int) -> str | None:
    """Why a batch of this size cannot run on the loaded model (None when it can): a sequence
    longer than the context, or more requests or KV slots than the pools hold."""
    context = runner.model_config.context_length
    if input_len + output_len > context:
        return (f"--input-len {input_len} + --output-len {output_len} exceeds the model's "
                f"context length, {context} tokens")
    rows = runner.req_to_token_pool.available_size()
    if batch_size > rows:
        return f"--batch-size {batch_size} exceeds the {rows} request slots"
    kv_slots = runner.token_to_kv_pool.available_size()
    needed = batch_size * (input_len + output_len - 1)
    if needed > kv_slots:
        return (f"batch {batch_size} x {input_len + output_len - 1} tokens needs {needed} KV "
                f"slots, the pool holds {kv_slots} (--max-total-tokens)")
    return None


def _free(runner: Any, reqs: list[Req]) -> None:
    table = runner.req_to_token_pool.req_to_token
    for req in reqs:
        if req.req_pool_idx is None:
            continue
        slots = table[req.req_pool_idx, :req.kv_len].to("cpu", torch.int64)
        runner.token_to_kv_pool.free(slots)
        runner.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None


def format_table(results: list[OneBatchResult], peak: hardware.DevicePeak) -> str:
    lines = [f"device {peak.name}: {peak.mem_bandwidth / 1e9:.1f} GB/s, "
             f"{peak.peak_flops / 1e12:.2f} TFLOP/s ({peak.source})",
             f"{'batch':>5} {'in':>5} {'out':>4} | {'prefill ms':>10} {'tok/s':>9} "
             f"{'limit ms':>9} {'ratio':>6} | {'decode ms':>9} {'tok/s':>9} {'limit ms':>9} "
             f"{'ratio':>6} {'bound':>7}"]
    for r in results:
        lines.append(f"{r.batch_size:>5} {r.input_len:>5} {r.output_len:>4} | "
                     f"{r.prefill_ms:>10.2f} {r.prefill_tok_s:>9.1f} {r.prefill_limit_ms:>9.3f} "
                     f"{r.prefill_ratio:>6.3f} | {r.decode_ms_per_step:>9.2f} "
                     f"{r.decode_tok_s:>9.1f} {r.decode_limit_ms:>9.3f} {r.decode_ratio:>6.3f} "
                     f"{r.decode_bound:>7}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve bench one-batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int_at_least(1), nargs="+", default=[1, 16])
    parser.add_argument("--input-len", type=int_at_least(1), default=128)
    parser.add_argument("--output-len", type=int_at_least(1), default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overlap", action="store_true",
                        help="time decode with the scheduler's overlap (launch-ahead) path")
    parser.add_argument("--output-file", type=output_file, default=None,
                        help="append one JSON line per batch size")
    hardware.add_peak_args(parser)
    ServerArgs.add_cli_args(parser, OFFLINE_GROUPS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """With --tp-size N the same run goes on in N processes, one per rank, in lockstep (the
    batches are seeded, so every rank builds the same ones); rank 0 reports. Decode limits then
    count each GPU's share of the bytes and FLOPs."""
    args = build_parser().parse_args(argv)
    if args.speculative_algorithm:
        raise SystemExit("one_batch times plain decode steps; speculative decoding is measured "
                         "by benchmarks/spec_ngram.py")
    if args.is_embedding:
        raise SystemExit("one_batch times generation; embedding models are measured by "
                         "benchmarks/embed_throughput.py")
    return run_command(lambda: _run_ranks(args))


def _run_ranks(args: argparse.Namespace) -> int:
    server_args = ServerArgs.from_cli_args(args).resolve()
    followers = []
    if server_args.tp_size > 1:
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
        followers = [ctx.Process(target=_run, args=(args, server_args, rank), daemon=True)
                     for rank in range(1, server_args.tp_size)]
        for process in followers:
            process.start()
    code = _run(args, server_args, 0)
    for process in followers:
        process.join()
        code = code or int(process.exitcode != 0)
    return code


def _run(args: argparse.Namespace, server_args: ServerArgs, tp_rank: int) -> int:
    from radixserve.executor.model_runner import ModelRunner

    runner = ModelRunner(server_args, tp_rank=tp_rank,
                         dist_init_method=server_args.dist_init_method)
    problem = why_batches_do_not_fit(runner, max(args.batch_size), args.input_len,
                                     args.output_len)
    if problem:
        runner.shutdown()
        if tp_rank:  # rank 0 reports it
            return 1
        raise BenchError(problem)
    peak = hardware.device_peak(runner.device, runner.dtype, args.bandwidth, args.peak_flops,
                                args.fp8_peak_flops, args.sustained_peak_flops)
    if server_args.tp_size > 1:  # each GPU moves and computes its share
        peak = peak.times(server_args.tp_size)
    # warm-up: lazy initialisation, allocator growth and kernel autotuning stay out of the figures
    max_prefill = server_args.max_prefill_tokens
    run_one_batch(runner, max(args.batch_size), args.input_len, min(args.output_len, 4), peak,
                  args.seed + 1, max_prefill_tokens=max_prefill)
    results = []
    for bs in args.batch_size:
        results.append(run_one_batch(runner, bs, args.input_len, args.output_len, peak,
                                     args.seed, overlap=args.overlap,
                                     max_prefill_tokens=max_prefill))
        if not tp_rank:  # as each batch finishes: a run cut short still reports its figures
            print(format_table(results[-1:], peak).splitlines()[-1], flush=True)
    runner.shutdown()
    if tp_rank:
        return 0
    print(format_table(results, peak))
    if args.output_file:
        date = datetime.now(timezone.utc).isoformat(timespec="seconds")
        with open(args.output_file, "a", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps({"date": date, "bench": "one-batch", "device": peak.name,
                                    "model_path": server_args.model_path,
                                    "dtype": str(runner.dtype).replace("torch.", ""),
                                    "mem_bandwidth": peak.mem_bandwidth,
                                    "peak_flops": peak.peak_flops,
                                    **{k: json_number(v) for k, v in asdict(r).items()
                                       if k != "output_ids"}}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
