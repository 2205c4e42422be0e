"""Where one prefill's GPU time goes (dummy bf16 weights, eager, no CUDA graphs).

    python3 benchmarks/gpu_profile_prefill.py [--model qwen3-next-80b-a3b] [--tokens 8192]
        [--json-model-override-args '{"num_hidden_layers": 12}']

Prefills one prompt to warm up, times a second one with CUDA events, then profiles a third
under torch.profiler and prints its CUDA kernels by total time (the top 22, with launch
counts): a prefill is one pass, so launch-heavy paths (a Python loop per chunk) show as many
small kernels against the few large GEMMs and attention kernels.
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
    parser.add_argument("--model", default="qwen3-next-80b-a3b",
                        help="a folder of benchmarks/configs/")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--json-model-override-args", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    n = args.tokens
    runner = ModelRunner(ServerArgs(model_path=str(CONFIGS / args.model), load_format="dummy",
                                    dtype="bfloat16", disable_cuda_graph=True,
                                    max_total_tokens=4 * n + 64, max_running_requests=8,
                                    context_length=2 * n + 64,
                                    json_model_override_args=args.json_model_override_args))
    driver = RunnerDriver(runner)
    driver.extend({0: [1] * n})
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    driver.extend({1: [2] * n})
    end.record()
    torch.cuda.synchronize()
    print(f"prefill of {n} tokens ({args.model}): {start.elapsed_time(end):.1f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        driver.extend({2: [3] * n})
        torch.cuda.synchronize()
    groups: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            groups[evt.key] += evt.device_time_total / 1000
            counts[evt.key] += evt.count
    print(f"GPU kernel time: {sum(groups.values()):.1f} ms")
    for name, t in sorted(groups.items(), key=lambda kv: -kv[1])[:22]:
        print(f"{t:8.2f} ms {counts[name]:6d}x  {name[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
