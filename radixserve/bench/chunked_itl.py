"""Inter-token latency of decoding streams while long prompts arrive, chunked prefill off vs on.

    python -m radixserve.bench.chunked_itl --chunk-size 128 --mixed

N streams (default 16) decode; once they all run, M long prompts (default 4 x 8 chunk sizes)
arrive at once. The scheduler is driven in-process (the Engine's scheduler) and every streamed
token is timestamped as the scheduler hands it out, so the figures are the scheduler's own: the
max and p99 gap between tokens of the streams, and the TTFT of the long prompts. One run per
setting: chunking off (-1), chunking on, and chunking on with --enable-mixed-chunk when --mixed.
"""
from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import numpy as np
import torch

from radixserve.core.io_struct import TokenizedGenerateReq
from radixserve.core.sampling_params import SamplingParams
from radixserve.bench.report import append_jsonl, format_table
from radixserve.engine import Engine


def _req(rid: str, ids: list[int], max_new: int) -> TokenizedGenerateReq:
    params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
    params.verify()
    params.normalize()
    return TokenizedGenerateReq(rid, None, ids, params, stream=True)


def run_once(engine: Engine, streams: int, stream_len: int, longs: int, long_len: int,
             seed: int) -> dict[str, Any]:
    scheduler = engine.scheduler
    rng = np.random.default_rng(seed)
    vocab = min(scheduler.runner.vocab_size, 30000)
    token_times: dict[str, list[float]] = {}
    arrival: dict[str, float] = {}

    def turn() -> None:
        for out in scheduler.run_turn():
            now = time.perf_counter()
            for rid, new in zip(out.rids, out.new_output_ids):
                token_times.setdefault(rid, []).extend([now] * len(new))

    for i in range(streams):
        scheduler.add_request(_req(f"s{i}", rng.integers(100, vocab, 32).tolist(), stream_len))
    while len(scheduler.running) < streams:
        turn()
    for _ in range(3):  # let the streams settle into decoding
        turn()
    for i in range(longs):
        rid = f"long{i}"
        arrival[rid] = time.perf_counter()
        scheduler.add_request(_req(rid, rng.integers(100, vocab, long_len).tolist(), 4))
    while scheduler.has_work():
        turn()
    gaps = np.concatenate([np.diff(token_times[f"s{i}"]) for i in range(streams)]) * 1000
    gaps = gaps[gaps > 0]  # tokens handed out together (several steps per turn) share a time
    ttft = [(token_times[rid][0] - t0) * 1000 for rid, t0 in arrival.items()]
    return {"itl_max_ms": float(gaps.max()), "itl_p99_ms": float(np.percentile(gaps, 99)),
            "itl_median_ms": float(np.median(gaps)), "long_ttft_mean_ms": float(np.mean(ttft)),
            "long_ttft_max_ms": float(np.max(ttft))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-len", type=int, default=96)
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-factor", type=int, default=8, help="long prompt = factor x chunk")
    parser.add_argument("--mixed", action="store_true", help="also run --enable-mixed-chunk")
    parser.add_argument("--output-file", default=None)
    args = parser.parse_args(argv)
    settings = [("off", -1, False), ("on", args.chunk_size, False)]
    if args.mixed:
        settings.append(("on+mixed", args.chunk_size, True))
    long_len = args.long_factor * args.chunk_size
    rows = []
    for name, chunk, mixed in settings:
        engine = Engine(model_path=args.model_path, load_format=args.load_format,
                        dtype=args.dtype, device=args.device, chunked_prefill_size=chunk,
                        enable_mixed_chunk=mixed,
                        max_prefill_tokens=max(16384, args.long_prompts * long_len))
        engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})  # warm-up
        row = {"chunking": name, "chunk_size": chunk, "long_len": long_len,
               **run_once(engine, args.streams, args.stream_len, args.long_prompts, long_len, 0)}
        rows.append(row)
        del engine
        gc.collect()  # free the model and its KV pool before the next engine sizes its own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(format_table(rows, [("chunking", "chunking", ""), ("itl_max_ms", "ITL max ms", ".1f"),
                              ("itl_p99_ms", "ITL p99 ms", ".1f"),
                              ("itl_median_ms", "ITL p50 ms", ".1f"),
                              ("long_ttft_mean_ms", "long TTFT mean ms", ".1f"),
                              ("long_ttft_max_ms", "long TTFT max ms", ".1f")]))
    append_jsonl(args.output_file, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
