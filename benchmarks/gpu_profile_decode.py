"""Where a decode step's GPU time goes (Llama-3.1-8B shapes by default, bf16 or FP8, dummy
weights).

    python3 benchmarks/gpu_profile_decode.py [--model qwen3-30b-a3b] [--batch 1]
        [--context 1024] [--quantization fp8]

Runs eager decode steps under torch.profiler and prints the CUDA kernels by total time, grouped
by kind, next to the bytes each must move; the sum of kernel time is the step time a CUDA graph
could reach with no launch gaps. With --graph it also replays the captured decode graph of that
batch size back to back and prints its GPU time per replay (kernels + the gaps between them,
no host work): the difference to the kernel sum is launch gaps inside the graph, the difference
to one-batch's ms/step is host work per step. The prompts are prefilled in passes of ~16K
tokens. This driver writes each request's table row by itself, so "Memcpy" rows of ~batch
calls per step are its own, not the engine's.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.config import ServerArgs  # noqa: E402
from radixserve.executor.model_runner import ModelRunner  # noqa: E402
from tests.models.runner_driver import RunnerDriver  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b",
                        help="a folder of benchmarks/configs/ (e.g. qwen3-30b-a3b)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--graph", action="store_true", help="also time graph replays")
    parser.add_argument("--quantization", default=None, help="e.g. fp8")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--json-model-override-args", default=None,
                        help='e.g. \'{"num_hidden_layers": 12}\' (fewer layers of a large model)')
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    steps_run = 3 + args.steps  # the warm-up and profiled steps
    runner = ModelRunner(ServerArgs(model_path=str(CONFIGS / args.model), load_format="dummy",
                                    dtype="bfloat16",
                                    disable_cuda_graph=not args.graph,
                                    cuda_graph_max_bs=args.batch,
                                    max_total_tokens=args.batch * (args.context + steps_run),
                                    max_running_requests=args.batch,
                                    context_length=args.context + steps_run + 64,
                                    quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype,
                                    json_model_override_args=args.json_model_override_args))
    driver = RunnerDriver(runner)
    per_prefill = max(1, 16384 // args.context)  # requests per prefill pass
    for first in range(0, args.batch, per_prefill):
        driver.extend({i: [1] * args.context
                       for i in range(first, min(args.batch, first + per_prefill))})
    for _ in range(3):
        driver.extend({i: [2] for i in range(args.batch)})
    torch.cuda.synchronize()
    graphs, runner.cuda_graph_runner = runner.cuda_graph_runner, None  # eager for the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            driver.extend({i: [2] for i in range(args.batch)})
        torch.cuda.synchronize()
    groups: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    total = 0.0
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = evt.device_time_total / args.steps / 1000  # ms per step
        total += t
        name = evt.key
        groups[name] += t
        counts[name] += evt.count // args.steps
    weights = ("; weights alone need 3.779 ms at 4.25 TB/s" if args.model == "llama-3.1-8b"
               and args.quantization is None else "")
    print(f"GPU kernel time per decode step ({args.model}, batch {args.batch}, ctx "
          f"{args.context}): {total:.3f} ms{weights}")
    for name, t in sorted(groups.items(), key=lambda kv: -kv[1])[:24]:
        print(f"{t:8.3f} ms {counts[name]:5d}x  {name[:110]}")
    if graphs is not None:
        graph = graphs.graphs[max(graphs.batch_sizes)]
        graph.replay()  # the inputs hold padding rows: harmless writes to slot 0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replays = 200
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"graph replay (batch {max(graphs.batch_sizes)}), back to back: "
              f"{start.elapsed_time(end) / replays:.3f} ms per replay (kernel sum {total:.3f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
