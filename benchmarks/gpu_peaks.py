"""The H200 ceilings the FP8 limits use, measured: dense matmul peak in bf16 and in FP8
(torch._scaled_mm, row-wise and tensor-wise scales), and the split-KV decode attention's read
rate over a bf16 and an FP8 KV cache at serving batch sizes (Llama-3.1-8B heads).

    python3 benchmarks/gpu_peaks.py [--matmul-only] [--full-clock] [--sustain SECONDS
        [--sustain-dtype bf16|fp8|fp8-fast]]

The peaks are bursts (a CUDA graph replayed for ~50 ms), at the SM clock an idle GPU starts
from; an FP8 8192^3 product reaches the 700 W limit within that burst, so its figure is already
power-held. --full-clock times a graph of only ~4 ms after two idle seconds, several times:
the rate at the full clock, which compute-bound phases get when memory-bound work around them
keeps the board under its limit (an FP8 W + KV decode step: session 21). --sustain instead runs
8192^3 matmuls (bf16, or FP8 `_scaled_mm` with row-wise scales) back to back for SECONDS
(fp8-fast: with `use_fast_accum`, as the engine's FP8 linears run since session 21) and prints
the rate of every ~2 s: the rate a compute-bound phase of a
long run gets once the board reaches its power limit (an H200 at 700 W: 665 against 796
TFLOP/s bf16 at 1,440 MHz; sample the clocks beside it with gpu_common.sh's telemetry_start).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def matmul_products(m: int, n: int, k: int) -> dict[str, Callable[[], None]]:
    """[m, k] x [n, k]^T on random operands, each kind as a callable: "bf16" (into one
    preallocated output), "fp8" (`_scaled_mm` on e4m3 codes, row-wise scales, the accumulator
    promoted), "fp8-fast" (the same with `use_fast_accum`, as the FP8 linears run) and
    "fp8-tensor" (one scale per operand)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8, b8t = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    sa = torch.rand(m, 1, device="cuda")
    sb = torch.rand(1, n, device="cuda")
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bt = b.t()
    one = torch.ones((), device="cuda")

    def scaled_mm(scale_a: torch.Tensor, scale_b: torch.Tensor,
                  fast: bool) -> Callable[[], None]:
        return lambda: torch._scaled_mm(a8, b8t, scale_a=scale_a, scale_b=scale_b,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)
    return {"bf16": lambda: torch.matmul(a, bt, out=out), "fp8": scaled_mm(sa, sb, False),
            "fp8-fast": scaled_mm(sa, sb, True), "fp8-tensor": scaled_mm(one, one, False)}


def matmul_peaks(size: int = 8192) -> None:
    from gpu_kernels import time_graph
    flops = 2 * size ** 3
    products = matmul_products(size, size, size)
    labels = {"bf16": "bf16 matmul", "fp8-tensor": "fp8 _scaled_mm, tensor-wise scales",
              "fp8": "fp8 _scaled_mm, row-wise scales",
              "fp8-fast": "fp8 _scaled_mm, row-wise scales, fast accumulation"}
    for kind, label in labels.items():
        t = time_graph(products[kind])
        print(f"{label} {size}^3: {flops / t / 1e12:7.1f} TFLOP/s", flush=True)


def full_clock_matmuls(repeats: int = 5, idle_seconds: float = 2.0,
                       graph_seconds: float = 0.004) -> None:
    """Each product as one graph of ~graph_seconds of back-to-back calls, replayed once after
    idle_seconds of an idle GPU; the best of `repeats` replays."""
    import time
    shapes = {"8192^3": (8192, 8192, 8192), "896 x 28672 x 4096 (gate_up, FP8 decode batch)":
              (896, 28672, 4096)}
    for label, (m, n, k) in shapes.items():
        flops = 2 * m * n * k
        products = matmul_products(m, n, k)
        for name in ("bf16", "fp8-fast", "fp8"):
            product = products[name]
            product()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            product()
            end.record()
            end.synchronize()
            calls = max(1, int(graph_seconds / (start.elapsed_time(end) * 1e-3)))
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                product()  # warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    product()
            best = 0.0
            for _ in range(repeats):
                time.sleep(idle_seconds)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                best = max(best, flops * calls / (start.elapsed_time(end) * 1e-3) / 1e12)
            print(f"full clock {label:<48} {name:<9} {best:7.1f} TFLOP/s "
                  f"({calls} calls, best of {repeats})", flush=True)
            del graph
        torch.cuda.empty_cache()


def decode_attention_rates() -> None:
    import gpu_kernels as gk
    from radixserve.attention.kernels.decode_attention import decode_attention_fwd
    for bs, ctx in ((64, 1536), (256, 1536), (512, 1536), (862, 1536)):
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            layer_bytes = 2 * bs * ctx * gk.NUM_KV_HEADS * gk.HEAD_DIM * dtype.itemsize
            layers = max(1, min(16, -(-(1 << 30) // layer_bytes)))
            pool = gk.make_pool([ctx] * bs, layers)
            k_bufs = [b.to(dtype) for b in pool.k_buffers]
            v_bufs = [b.to(dtype) for b in pool.v_buffers]
            splits = gk.kv_splits_for(bs)
            q = torch.randn(bs, gk.NUM_HEADS, gk.HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            out = torch.empty_like(q)
            mid_out = torch.empty(bs, gk.NUM_HEADS, splits, gk.HEAD_DIM, device="cuda")
            mid_lse = torch.empty(bs, gk.NUM_HEADS, splits, device="cuda")

            def step() -> None:
                for k_buf, v_buf in zip(k_bufs, v_bufs):
                    decode_attention_fwd(q, k_buf, v_buf, out, pool.req_to_token,
                                         pool.req_pool_indices, pool.seq_lens, mid_out,
                                         mid_lse, gk.HEAD_DIM ** -0.5, k_scale=0.5,
                                         v_scale=0.5)
            seconds = gk.time_graph(step) / layers
            print(f"decode attention bs={bs:<4} ctx={ctx} {str(dtype):<20} "
                  f"{seconds * 1e6:8.1f} us/layer {layer_bytes / seconds / 1e12:5.2f} TB/s",
                  flush=True)
            del pool, k_bufs, v_bufs
            torch.cuda.empty_cache()


def sustained_matmul(seconds: float, dtype: str = "bf16", size: int = 8192,
                     window: float = 2.0) -> None:
    """Matmuls back to back for `seconds`; the rate of each ~`window`-second stretch. dtype:
    a kind of `matmul_products` ("fp8-fast" is what the FP8 linears run)."""
    import time
    product = matmul_products(size, size, size)[dtype]
    flops = 2 * size ** 3
    product()
    torch.cuda.synchronize()
    per_call = 0.002  # refined after the first stretch
    rates = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        calls = max(1, int(window / per_call))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            product()
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) * 1e-3
        per_call = elapsed / calls
        rates.append(flops / per_call / 1e12)
        print(f"sustained {dtype} matmul {size}^3, "
              f"{time.perf_counter() - deadline + seconds:6.1f} s: {rates[-1]:7.1f} TFLOP/s",
              flush=True)
    tail = rates[len(rates) // 2:]
    print(f"sustained {dtype} matmul: first stretch {rates[0]:.1f}, second half's median "
          f"{sorted(tail)[len(tail) // 2]:.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sustain", type=float, default=0.0,
                        help="seconds of back-to-back matmuls instead of the burst peaks")
    parser.add_argument("--sustain-dtype", choices=("bf16", "fp8", "fp8-fast"), default="bf16")
    parser.add_argument("--matmul-only", action="store_true",
                        help="the burst matmul peaks only (no decode attention rates)")
    parser.add_argument("--full-clock", action="store_true",
                        help="only the matmul rates of ~4 ms graphs after idle seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_peaks: no CUDA device")
        sys.exit(0)
    if args.sustain > 0:
        sustained_matmul(args.sustain, args.sustain_dtype)
        sys.exit(0)
    if args.full_clock:
        full_clock_matmuls()
        sys.exit(0)
    matmul_peaks()
    if not args.matmul_only:
        decode_attention_rates()
