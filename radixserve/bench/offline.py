"""Offline throughput: the in-process Engine on a whole workload at once, no HTTP.

`radixserve bench offline --dataset-name generated-shared-prefix --radix both` (server flags
such as --model-path, --dtype are accepted too). All requests are handed to the Engine in one
generate() call; the figure is tokens over wall time, with the radix cache on, off, or both
(one fresh Engine each, so neither run inherits the other's cache). Every request asks for
greedy decoding with ignore_eos, and the reported completion lengths are checked against it.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np

from radixserve.bench import hardware
from radixserve.bench.cli_support import BenchError, output_file, run_command
from radixserve.bench.datasets import (SampleRequest, TokenSampler, add_dataset_args,
                                       build_dataset, check_asks_for_requests, check_not_empty,
                                       load_tokenizer)
from radixserve.bench.metrics import json_number
from radixserve.config import ServerArgs
from radixserve.core.sampling_params import InvalidRequestError
from radixserve.core.server_flags import OFFLINE_GROUPS


@dataclass
class OfflineResult:
    radix_cache: bool
    num_prompts: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    expected_output_tokens: int
    output_len_mismatches: int
    cached_tokens: int
    cache_hit_rate: float  # cached prompt tokens / prompt tokens
    request_throughput: float
    output_throughput: float  # completion tokens / s
    total_throughput: float  # (prompt + completion) tokens / s
    # hardware.workload_limit_seconds of the workload (NaN when no peak was given), and
    # limit / duration: the fraction of the hardware's limit the run reached
    limit_s: float = float("nan")
    limit_ratio: float = float("nan")
    # the same with the FLOP/s the device holds at its power limit (NaN when unknown): a
    # minute-long run cannot beat this one (hardware.DevicePeak.sustained)
    sustained_limit_s: float = float("nan")
    sustained_limit_ratio: float = float("nan")
    # requests retracted during the run, and the tokens prefilled again because of it
    retractions: int = 0
    recomputed_tokens: int = 0
    # the scheduler's decode steps during the run: each reads the weights once, so at a given
    # token count fewer steps (bigger batches) is the cheaper run (--admission-plan cohorts)
    decode_steps: int = 0


def engine_vocab_size(engine: Any) -> int | None:
    runner = getattr(getattr(engine, "scheduler", None), "runner", None)
    return getattr(runner, "vocab_size", None)


def _sampling(output_len: int) -> dict[str, Any]:
    return {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}


def run_offline(engine: Any, requests: list[SampleRequest], radix_cache: bool,
                warmup_seed: int = 12345,
                peak: hardware.DevicePeak | None = None) -> OfflineResult:
    """One generate() call over the workload after a one-request warm-up (a different prompt).
    With a hardware.DevicePeak, the result carries the workload's roofline limit."""
    sampler = TokenSampler(engine.tokenizer, engine_vocab_size(engine))
    warm_ids = sampler.sample(np.random.default_rng(warmup_seed), requests[0].prompt_len)
    engine.generate(input_ids=[warm_ids], sampling_params=[_sampling(4)])

    params = [_sampling(r.output_len) for r in requests]
    before = _scheduler_counts(engine)
    start = time.perf_counter()
    if all(r.prompt_ids is not None for r in requests):
        outputs = engine.generate(input_ids=[r.prompt_ids for r in requests],
                                  sampling_params=params)
    else:
        outputs = engine.generate(prompt=[r.prompt_text for r in requests],
                                  sampling_params=params)
    duration = time.perf_counter() - start
    after = _scheduler_counts(engine)

    metas = [o["meta_info"] for o in outputs]
    total_in = sum(int(m["prompt_tokens"]) for m in metas)
    total_out = sum(int(m["completion_tokens"]) for m in metas)
    cached = sum(int(m.get("cached_tokens") or 0) for m in metas)
    return OfflineResult(
        radix_cache=radix_cache, num_prompts=len(requests), duration_s=duration,
        total_input_tokens=total_in, total_output_tokens=total_out,
        expected_output_tokens=sum(r.output_len for r in requests),
        output_len_mismatches=sum(int(m["completion_tokens"]) != r.output_len
                                  for m, r in zip(metas, requests)),
        cached_tokens=cached, cache_hit_rate=cached / total_in if total_in else 0.0,
        request_throughput=len(requests) / duration, output_throughput=total_out / duration,
        total_throughput=(total_in + total_out) / duration,
        retractions=after[0] - before[0], recomputed_tokens=after[1] - before[1],
        decode_steps=after[2] - before[2],
        **_limit(engine, requests, duration, peak))


def _scheduler_counts(engine: Any) -> tuple[int, int, int]:
    """The scheduler's retractions, recomputed tokens and decode steps since its start."""
    state = engine.get_internal_state()
    return (int(state.get("num_retractions", 0)), int(state.get("num_recomputed_tokens", 0)),
            int(state.get("num_decode_steps", 0)))


def _limit(engine: Any, requests: list[SampleRequest], duration: float,
           peak: hardware.DevicePeak | None) -> dict[str, float]:
    runner = getattr(getattr(engine, "scheduler", None), "runner", None)
    if peak is None or runner is None:
        return {}

    def limit(peak: hardware.DevicePeak) -> float:
        return hardware.workload_limit_seconds(
            runner.model_config, [r.prompt_len for r in requests],
            [r.output_len for r in requests], runner.dtype, peak,
            runner.kv_cache_spec.storage_dtype,
            fp8_linears=getattr(runner, "fp8", None) is not None)
    burst = limit(peak)
    limits = {"limit_s": burst, "limit_ratio": burst / duration}
    sustained_peak = peak.sustained()
    if sustained_peak is not None:
        sustained = limit(sustained_peak)
        limits.update(sustained_limit_s=sustained, sustained_limit_ratio=sustained / duration)
    return limits


def format_results(results: list[OfflineResult]) -> str:
    lines = [f"{'radix':>5} {'prompts':>7} {'duration s':>10} {'in tok':>8} {'out tok':>8} "
             f"{'hit rate':>8} {'req/s':>7} {'out tok/s':>9} {'total tok/s':>11} {'mismatch':>8} "
             f"{'limit s':>8} {'ratio':>6} {'at cap s':>8} {'ratio':>6} {'retracted':>9} "
             f"{'recomputed':>10} {'decode steps':>12}"]
    for r in results:
        lines.append(f"{'on' if r.radix_cache else 'off':>5} {r.num_prompts:>7} "
                     f"{r.duration_s:>10.2f} {r.total_input_tokens:>8} "
                     f"{r.total_output_tokens:>8} {r.cache_hit_rate:>8.3f} "
                     f"{r.request_throughput:>7.2f} {r.output_throughput:>9.1f} "
                     f"{r.total_throughput:>11.1f} {r.output_len_mismatches:>8} "
                     f"{r.limit_s:>8.2f} {r.limit_ratio:>6.3f} {r.sustained_limit_s:>8.2f} "
                     f"{r.sustained_limit_ratio:>6.3f} {r.retractions:>9} "
                     f"{r.recomputed_tokens:>10} {r.decode_steps:>12}")
    lines.append("limit: hardware.workload_limit_seconds (FLOPs / peak + decode KV bytes / "
                 "bandwidth, no prefix sharing); ratio = limit / duration; at cap: the same "
                 "limit at the FLOP/s held at the power limit (NaN: unknown); retracted: requests "
                 "sent back to the queue when decode ran out of KV, recomputed: their tokens "
                 "prefilled again; decode steps: the scheduler's, each one weight read")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve bench offline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_args(parser)
    parser.add_argument("--radix", choices=("on", "off", "both"), default="both",
                        help="run with the radix cache on, off, or one run of each")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer for ShareGPT lengths (default: the model's)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-file", type=output_file, default=None,
                        help="append one JSON line per run")
    hardware.add_peak_args(parser)
    ServerArgs.add_cli_args(parser, OFFLINE_GROUPS)
    parser.set_defaults(num_prompts=64, random_input_len=128, random_output_len=128)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: run_modes(args))


def run_modes(args: argparse.Namespace) -> int:
    check_asks_for_requests(args)  # before loading a model
    from radixserve.engine import Engine
    import logging
    # the scheduler's batch lines (running, queued, throughput) go to stderr as the server's do
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.radix]
    results: list[OfflineResult] = []
    peak: hardware.DevicePeak | None = None
    for radix in modes:
        server_args = ServerArgs.from_cli_args(args)
        server_args.disable_radix_cache = not radix
        engine = Engine(**{k: v for k, v in vars(server_args).items() if k != "resolved"})
        try:
            requests = check_not_empty(build_dataset(args, tokenizer or engine.tokenizer,
                                                     args.seed, engine_vocab_size(engine)))
            if peak is None:  # measured once: every run uses the same device and dtype
                # (no local reference to the runner: it must go with its Engine, or --radix
                # both holds two models' memory)
                peak = hardware.device_peak(engine.scheduler.runner.device,
                                            engine.scheduler.runner.dtype, args.bandwidth,
                                            args.peak_flops, args.fp8_peak_flops,
                                            args.sustained_peak_flops)
                tp = server_args.tp_size
                if tp > 1:  # the ranks share the work: the limit counts every GPU
                    peak = peak.times(tp)
            try:
                results.append(run_offline(engine, requests, radix, peak=peak))
            except InvalidRequestError as exc:
                raise BenchError(f"the engine refused the workload: {exc}")
        finally:
            engine.shutdown()
            del engine
            gc.collect()
    print(format_results(results))
    if any(r.output_len_mismatches for r in results):
        print("warning: some requests returned a different number of tokens than asked for")
    if args.output_file:
        date = datetime.now(timezone.utc).isoformat(timespec="seconds")
        with open(args.output_file, "a", encoding="utf-8") as f:
            for r in results:
                fields = {key: json_number(value) for key, value in asdict(r).items()}
                f.write(json.dumps({"date": date, "bench": "offline",
                                    "model_path": args.model_path,
                                    "dataset_name": args.dataset_name, "seed": args.seed,
                                    **fields}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
