"""Does a weight prefetched into L2 under a latency-bound kernel make its product faster?

For each product of Llama-3.1-8B's decode layer (one row by default) this replays CUDA graphs
of: an L2 flush (a 256 MiB fill), optionally the bulk prefetch of a share of the weight
(kernels/l2_prefetch.py), a sleep standing in for attention (torch.cuda._sleep), then the
product through `linear()` (the tables' kernel). The product's time is the graph's time less
that of the same graph without it; so "with" against "without" says how much of the prefetched
share the product then read from L2 instead of HBM.

    python3 benchmarks/gpu_l2_prefetch.py [--rows 1 8] [--shares 0.5 1] [--sleep-us 0 10]
"""
from __future__ import annotations

import argparse

import torch

from radixserve.layers.kernels.l2_prefetch import prefetch_bytes, prefetch_to_l2
from radixserve.layers.linear import linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def graph_time_us(fn, replays: int = 200) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / replays


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--products", nargs="+", default=list(SHAPES))
    parser.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1 << 14, 1 << 16, 1 << 18])
    parser.add_argument("--sleep-us", type=float, nargs="+", default=[0.0, 10.0])
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    clock_hz = 1.98e9
    print(f"{props.name}: L2 {props.L2_cache_size / 2**20:.0f} MiB, "
          f"{props.multi_processor_count} SMs")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for product in args.products:
        n, k = SHAPES[product]
        weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        for rows in args.rows:
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            reference = linear(x, weight)
            for sleep_us in args.sleep_us:
                cycles = int(sleep_us * 1e-6 * clock_hz)

                def run(share: float, chunk: int, with_product: bool) -> None:
                    flush.fill_(1)
                    if share > 0:
                        prefetch_to_l2(weight, prefetch_bytes(weight, share), chunk)
                    if cycles:
                        torch.cuda._sleep(cycles)
                    if with_product:
                        linear(x, weight)

                base = graph_time_us(lambda: run(0.0, 1 << 16, False))
                plain = graph_time_us(lambda: run(0.0, 1 << 16, True)) - base
                gbytes = n * k * 2 / 1e9
                print(f"{product} rows {rows} sleep {sleep_us:.0f} us: no prefetch {plain:.2f} us "
                      f"({gbytes / plain * 1e3:.2f} TB/s)")
                for chunk in args.chunks:
                    for share in args.shares:
                        alone = graph_time_us(lambda: run(share, chunk, False))
                        total = graph_time_us(lambda: run(share, chunk, True))
                        print(f"   share {share:.2f} ({prefetch_bytes(weight, share) / 2**20:.0f}"
                              f" MiB) chunk {chunk >> 10} KiB: product {total - alone:.2f} us, "
                              f"prefetch's own cost {alone - base:+.2f} us")
            out = linear(x, weight)
            torch.cuda.synchronize()
            assert torch.equal(out, reference), "the product changed after prefetches"


if __name__ == "__main__":
    main()
