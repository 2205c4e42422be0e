"""CUDA kernel time of an offline random workload, grouped by kind, against its wall time: where
a prefill-heavy run (issue 17's short-requests row) spends the GPU.

    python3 benchmarks/gpu_profile_offline.py [--num-prompts 1000] [--input-len 128]
        [--output-len 8] [engine flags as key=value, e.g. enable_mixed_chunk=true]
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.dummy_engine import dummy_engine, greedy_params, workload_parser  # noqa: E402

GROUPS = (("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "xmma", "cublas")),
          ("extend attention", ("_extend_kernel", "cudnn", "fmha", "flash")),
          ("decode attention", ("_decode_split", "_decode_merge", "_decode")),
          ("rmsnorm", ("rmsnorm",)), ("rope / kv store", ("rotary", "rope", "kv_store")),
          ("silu", ("silu",)), ("sampling / argmax", ("argmax", "reduce", "softmax", "sort")),
          ("copies / index", ("copy", "index", "gather", "scatter", "fill", "cat", "elementwise")))


def group_of(name: str) -> str:
    lower = name.lower()
    for group, keys in GROUPS:
        if any(k in lower for k in keys):
            return group
    return "other"


def main() -> None:
    args = workload_parser(default_prompts=1000).parse_args()
    engine = dummy_engine(args)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 30000, args.input_len).tolist()
               for _ in range(args.num_prompts)]
    params = greedy_params(args)
    engine.generate(input_ids=prompts[:64], sampling_params=params)  # warm-up, every shape
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    totals: dict[str, float] = defaultdict(float)
    names: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in prof.key_averages():
        cuda_us = getattr(event, "self_device_time_total", None)
        if cuda_us is None:
            cuda_us = getattr(event, "self_cuda_time_total", 0.0)
        # CPU-side ops (aten::mm, launches) carry their kernels' time again: count kernels only
        if cuda_us <= 0 or event.key.startswith(("aten::", "cuLaunch", "cuda")):
            continue
        group = group_of(event.key)
        totals[group] += cuda_us / 1e6
        names[group][event.key[:70]] += cuda_us / 1e6
    busy = sum(totals.values())
    print(f"wall {wall:.2f} s for {args.num_prompts} x {args.input_len}/{args.output_len}; "
          f"GPU kernels {busy:.2f} s ({100 * busy / wall:.0f}% of wall)")
    for group, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        top = sorted(names[group].items(), key=lambda kv: -kv[1])[:3]
        print(f"  {group:18s} {seconds:6.2f} s  " +
              "; ".join(f"{n} {s:.2f}" for n, s in top))
    engine.shutdown()


if __name__ == "__main__":
    main()
