"""torch.profiler table of CPU decode steps (SmolLM2-135M by default).

    python benchmarks/cpu_profile_decode.py --dtype bfloat16 --batch-size 64 --input-len 128

Prefills `batch` random prompts, runs a few warm-up decode steps, then profiles `--steps` steps
and prints the op table (self CPU time) and the mean wall time per step. Server flags
(--model-path, --attention-backend, ...) are accepted.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from radixserve.bench import one_batch
from radixserve.config import ServerArgs
from radixserve.core.server_flags import OFFLINE_GROUPS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--row-limit", type=int, default=25)
    ServerArgs.add_cli_args(parser, OFFLINE_GROUPS)
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args).resolve()
    from radixserve.executor.model_runner import ModelRunner
    from radixserve.mem.chunk_cache import ChunkCache
    from radixserve.scheduler.batch import BatchBuilder

    runner = ModelRunner(server_args, tp_rank=0, dist_init_method=server_args.dist_init_method)
    cfg = runner.model_config
    builder = BatchBuilder(runner.req_to_token_pool, runner.token_to_kv_pool,
                           ChunkCache(runner.req_to_token_pool, runner.token_to_kv_pool),
                           runner.vocab_size, set(cfg.eos_token_ids), runner.device)
    reqs = one_batch._make_reqs(args.batch_size, args.input_len, 4 + 2 * args.steps,
                                cfg.vocab_size, 0)

    def step() -> None:
        out = runner.forward(builder.prepare_decode(reqs))
        for req, token in zip(reqs, out.next_token_ids):
            req.output_ids.append(int(token))

    out = runner.forward(builder.prepare_extend(reqs))
    for req, token in zip(reqs, out.next_token_ids):
        req.output_ids.append(int(token))
    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    wall = (time.perf_counter() - start) / args.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    print(f"batch {args.batch_size}, context ~{args.input_len}: {wall * 1e3:.1f} ms/step "
          f"unprofiled, {args.batch_size / wall:.1f} tok/s, "
          f"threads {torch.get_num_threads()}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.row_limit))
    one_batch._free(runner, reqs)
    runner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
