"""The scheduler's own host cost per request, with a model runner that costs nothing: what issue
17's short-requests row (4,000 x 128 in / 8 out) spends on the host outside the model.

    python3 benchmarks/cpu_scheduler_cost.py [--num-prompts 4000] [--input-len 128]
        [--output-len 8] [--max-total-tokens 400000] [--context-len 131072] [--profile 25]
        [--admission-plan cohorts] [--chunked-prefill-size 8192]

The runner (the scheduler tests' FakeRunner without its model) keeps real pools (the request
table, rows of --context-len, and a KV pool of one float per slot; --max-total-tokens below the workload's 544K tokens makes the prefix cache
evict), writes decode slots as the ModelRunner does, and returns token 1 for every request at
once, so the time measured is admission, the prefix cache, batch building, output handling and
the scheduler's bookkeeping, on this CPU. --profile N prints cProfile's N largest cumulative
entries. It also prints the decode steps and the prefills that admitted requests: with the GPU's
pool sizes (`--max-total-tokens 1741507`, FP8 KV; 870753, bf16) and 1,000 x 1024/1024 these
are the H200 offline runs' cohorts, as this scheduler forms them (`--admission-plan`).
Figures only; nothing asserts on time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.bench.datasets import uniform_lengths  # noqa: E402
from radixserve.config import ServerArgs  # noqa: E402
from radixserve.core.forward_batch import ModelWorkerBatch  # noqa: E402
from radixserve.core.io_struct import TokenizedGenerateReq  # noqa: E402
from radixserve.core.sampling_params import SamplingParams  # noqa: E402
from radixserve.scheduler.scheduler import Scheduler  # noqa: E402
from tests.scheduler.fake_runner import FakeRunner  # noqa: E402

VOCAB = 32000


class NullRunner(FakeRunner):
    """The scheduler tests' runner (real pools) without its model or its checks: every pass
    returns token 1 per request."""

    def __init__(self, max_total_tokens: int, max_reqs: int, context_len: int) -> None:
        super().__init__(max_total_tokens, max_reqs, context_len)
        self.vocab_size = VOCAB

    def _run(self, batch: ModelWorkerBatch, input_ids: list[int]) -> list[int]:
        if batch.forward_mode.is_decode():  # as the ModelRunner does for every DECODE pass
            self.req_to_token_pool.write_decode_slots(
                torch.tensor(batch.req_pool_indices), torch.tensor(batch.seq_lens),
                batch.out_cache_loc)
        return [1] * len(batch.req_pool_indices)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=4000)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--max-total-tokens", type=int, default=400_000)
    parser.add_argument("--max-running-requests", type=int, default=1024)
    parser.add_argument("--context-len", type=int, default=131072,
                        help="the request table's row width (Llama-3.1's context by default, "
                             "as the H200 runs size it)")
    parser.add_argument("--profile", type=int, default=0, help="cProfile's N top entries")
    parser.add_argument("--admission-plan", default="greedy", choices=("greedy", "cohorts"))
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="default: the CPU's (512); the GPU's is 8192")
    parser.add_argument("--random-range-ratio", type=float, default=1.0,
                        help="lengths drawn uniformly from [ratio x len, len], as bench's random "
                             "dataset draws them (1.0: every request the same)")
    args = parser.parse_args()
    context = args.context_len
    runner = NullRunner(args.max_total_tokens, args.max_running_requests, context)
    scheduler = Scheduler(ServerArgs(device="cpu", max_running_requests=args.max_running_requests,
                                     admission_plan=args.admission_plan,
                                     chunked_prefill_size=args.chunked_prefill_size),
                          runner, None, {0}, context)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)  # the lengths as bench's random dataset draws them
    input_lens = uniform_lengths(rng, args.input_len, args.random_range_ratio, args.num_prompts)
    output_lens = uniform_lengths(rng, args.output_len, args.random_range_ratio,
                                  args.num_prompts)
    prompts = [torch.randint(100, VOCAB, (n,), generator=gen).tolist() for n in input_lens]
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for i, (prompt, output_len) in enumerate(zip(prompts, output_lens)):
        params = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
        params.verify()
        params.normalize()
        scheduler.add_request(TokenizedGenerateReq(rid=f"r{i}", input_text=None, input_ids=prompt,
                                                   sampling_params=params, stream=False))
    turns = finished = prefills = 0
    admissions: list[tuple[int, int]] = []  # (decode steps so far, requests that joined)
    last_admission_step = -100
    while scheduler.has_work():
        admitted = len(scheduler.admitted_reqs())
        queued = len(scheduler.waiting_queue)
        for out in scheduler.run_turn():
            finished += sum(reason is not None for reason in out.finished_reasons)
        turns += 1
        joined = queued - len(scheduler.waiting_queue)
        if joined > 0:
            prefills += 1
            steps = scheduler.stats.num_decode_steps
            if admitted and steps - last_admission_step <= 4:  # the same ramp goes on (a
                # prefill, then a decode step or two)
                admissions[-1] = (admissions[-1][0], admissions[-1][1] + joined)
            else:
                admissions.append((steps, joined))
            last_admission_step = steps
    if profiler is not None:
        profiler.disable()
    seconds = time.perf_counter() - start
    ok, leaked = scheduler.check_memory()
    print(f"{args.num_prompts} x {args.input_len}/{args.output_len}: {seconds:.2f} s on the "
          f"host, {seconds / args.num_prompts * 1e6:.0f} us per request, {turns} turns, "
          f"{finished} finished, memory check {'ok' if ok else f'FAILED ({leaked} leaked)'}; "
          f"{scheduler.stats.num_decode_steps} decode steps, {prefills} prefills that admitted, "
          f"admitted (decode step, requests) {admissions[:8]}")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
