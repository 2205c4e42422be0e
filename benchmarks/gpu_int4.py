"""Time the W4A16 product (layers/kernels/int4_gemm.py) on a GPU at Llama-3.1-8B's linear
shapes, against cuBLAS on the same weight in bf16, and sweep its launch shapes.

  python benchmarks/gpu_int4.py                 # the default shapes' table
  python benchmarks/gpu_int4.py --sweep         # also the launch shapes of _candidates

Each product is checked against the dequantised weight first. Times are CUDA-graph replays of
ten products over ten different weights (so weights come from HBM, not L2), per product;
bandwidth counts the bytes the int4 weight, its scales and zero points take. Figures only.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from radixserve.layers.kernels import gemv, int4_gemm  # noqa: E402
from radixserve.layers.quantization.int4 import dequantize_int4, unpack_int32  # noqa: E402

# (name, N, K) of Llama-3.1-8B's decoder products at tp 1
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336)]
COPIES = 10  # distinct weights per replay: 10 x the largest is 590 MB, past any L2
GROUP = 128


def _weights(n: int, k: int, device: str):
    gen = torch.Generator(device=device).manual_seed(n + k)
    out = []
    for _ in range(COPIES):
        qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), generator=gen,
                                dtype=torch.int32, device=device)
        scales = (torch.rand(n, k // GROUP, generator=gen, device=device) * 0.01 + 1e-3
                  ).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (n, k // GROUP), generator=gen, dtype=torch.uint8,
                              device=device)
        out.append((qweight, scales, zeros))
    return out


def _graph_ms(fn) -> float:
    """Median ms of one call of fn (which runs COPIES products), from graph replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] / COPIES


def _check(x, weights) -> float:
    qweight, scales, zeros = weights[0]
    got = int4_gemm.int4_matmul(x, qweight, scales, zeros, GROUP, None).float()
    k = x.shape[1]
    dense = dequantize_int4(unpack_int32(qweight), scales, zeros,
                            torch.arange(k, device=x.device) // GROUP, torch.float32)
    want = x.float() @ dense.t()
    return ((got - want).abs().max() / want.abs().max()).item()


def _candidates(m: int, default: int4_gemm.GemmShape) -> list[int4_gemm.GemmShape]:
    """The launch shapes --sweep times for m rows: at one row the GEMV (codes through the
    exponent bits, shifted or in place, or converted); else the tensor-core kernel's tiles,
    split K, one or two spans a step."""
    shape = int4_gemm.GemmShape
    if m == 1:
        rows = [shape(1, block_n, split, warps, 3, magic=True, step_spans=spans,
                      in_place=in_place)
                for block_n, split, warps, spans, in_place in itertools.product(
                    (8, 16), (1,), (1, 2, 4), (4, 8), (False, True))]
        return rows + [shape(1, 16, 1, 4, 3, step_spans=8)]  # codes converted
    return [shape(default.block_m, block_n, split, 4, 3, magic=True, step_spans=spans)
            for block_n, split, spans in itertools.product((32, 64, 128), (1, 2, 4), (1, 2))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    args = parser.parse_args()
    device = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs")
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        weights = _weights(n, k, device)
        dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.01
                 for _ in range(COPIES)]
        int4_bytes = n * k / 2 + n * (k // GROUP) * 3
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            error = _check(x, weights)
            ms = _graph_ms(lambda: [int4_gemm.int4_matmul(x, *w, GROUP, None)
                                    for w in weights])
            bf16_ms = _graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in dense])
            default = int4_gemm._gemm_shape(m, n, k, int4_gemm.block_k_for(k, GROUP), sms)
            line = (f"{name:8s} M={m:<4d} int4 {ms * 1e3:8.1f} us {int4_bytes / ms / 1e6:7.0f}"
                    f" GB/s | bf16 cuBLAS {bf16_ms * 1e3:8.1f} us ({bf16_ms / ms:4.2f}x) | "
                    f"rel err {error:.1e} | {tuple(default)}")
            if args.sweep and m < int4_gemm.DEQUANT_MIN_ROWS:
                best = (ms, default)
                for shape in _candidates(m, default):
                    try:
                        t = _graph_ms(lambda: [int4_gemm.int4_matmul(x, *w, GROUP, None, shape)
                                               for w in weights])
                    except Exception as exc:  # noqa: BLE001  (out of resources)
                        print(f"   {tuple(shape)}: {type(exc).__name__}")
                        continue
                    print(f"   {name} M={m} {t * 1e3:8.1f} us {tuple(shape)}")
                    if t < best[0]:
                        best = (t, shape)
                line += f" | best {best[0] * 1e3:.1f} us {tuple(best[1])}"
            if m == 1:  # the floor: the bf16 GEMV over a weight of the codes' bytes
                same_bytes = [w[:, : k // 4].contiguous() for w in dense]
                x_quarter = x[:, : k // 4].contiguous()
                floor = _graph_ms(lambda: [gemv.gemv(x_quarter, w) for w in same_bytes])
                line += f" | bf16 GEMV over as many bytes {floor * 1e3:.1f} us"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
