"""CUDA kernel time of an offline random workload, grouped by kind, against its wall time: where
a prefill-heavy run (issue 17's short-requests row) spends the GPU.

    python3 benchmarks/gpu_profile_offline.py [--num-prompts 1000] [--input-len 128]
        [--output-len 8] [--window START SECONDS] [engine flags as key=value, e.g.
        enable_mixed_chunk=true]

--window profiles only SECONDS of the run, from START seconds after it begins (a thread starts
and stops the profiler; CUDA activity is traced process-wide): the steady state of a long run,
e.g. the decode wave of 1000 x 1024/1024, without tracing the whole run. Busy is the union of
the kernels' intervals, so the idle share counts the GPU doing nothing at all.
"""
from __future__ import annotations

import sys
import threading
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


def busy_union(prof: object) -> tuple[float, float]:
    """Seconds covered by at least one kernel or copy, and first start to last end."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    if not intervals:
        return 0.0, 0.0
    covered, (cur_start, cur_end) = 0.0, intervals[0]
    for begin, end in intervals[1:]:
        if begin > cur_end:
            covered += cur_end - cur_start
            cur_start, cur_end = begin, end
        else:
            cur_end = max(cur_end, end)
    covered += cur_end - cur_start
    return covered / 1e6, (intervals[-1][1] - intervals[0][0]) / 1e6  # microseconds


def main() -> None:
    parser = workload_parser(default_prompts=1000)
    parser.add_argument("--window", type=float, nargs=2, metavar=("START", "SECONDS"))
    args = parser.parse_args()
    engine = dummy_engine(args)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 30000, args.input_len).tolist()
               for _ in range(args.num_prompts)]
    params = greedy_params(args)
    engine.generate(input_ids=prompts[:64], sampling_params=params)  # warm-up, every shape
    from torch.profiler import ProfilerActivity, profile
    if args.window:
        prof = profile(activities=[ProfilerActivity.CUDA])
        window_start, window_len = args.window

        def profile_window() -> None:
            time.sleep(window_start)
            prof.start()
            time.sleep(window_len)
            prof.stop()
        thread = threading.Thread(target=profile_window, daemon=True)
        thread.start()
        engine.generate(input_ids=prompts, sampling_params=params)
        thread.join()
        wall = window_len
    else:
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
    if args.window:
        union, span = busy_union(prof)
        print(f"window: kernels span {span:.3f} s, busy (union of intervals) {union:.3f} s, "
              f"idle {span - union:.3f} s ({100 * (span - union) / max(span, 1e-9):.1f}%)")
    for group, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        top = sorted(names[group].items(), key=lambda kv: -kv[1])[:3]
        print(f"  {group:18s} {seconds:6.2f} s  " +
              "; ".join(f"{n} {s:.2f}" for n, s in top))
    engine.shutdown()


if __name__ == "__main__":
    main()
