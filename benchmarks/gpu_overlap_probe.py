"""Can a large decode step overlap its compute-bound GEMMs with its memory-bound attention?

A stand-in for a Llama-3.1-8B decode step at the batches the offline run holds (no norms or
rotary, which are small): per layer the q|k|v product, decode attention over the pool, then o,
gate|up, SiLU-mul and down. Layers have distinct weights and KV, so nothing stays in L2.

Modes (ms per layer, eager launches; at these batches a layer's GPU time is ~1 ms, far above
its launch cost):
- serial: the whole batch, one stream (what the model runs now);
- halves: two nano-batches one after the other on one stream (the cost of splitting);
- streams: two nano-batches pipelined over an attention stream and a GEMM stream, so one
  half's attention runs while the other half's GEMMs do (NanoFlow's nano-batches);
- carve N: the same, with cuBLAS told to leave N SMs free (torch's SM carveout);
- green G: the same, the GEMM stream on a green context of G SMs and the attention stream on
  one made of the remaining SMs (disjoint partitions through the driver API, by ctypes).

    python3 benchmarks/gpu_overlap_probe.py [--cases bf16 kv8 w8kv8] [--layers 6]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

HIDDEN, INTER, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
QKV = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
CASES = {  # name: (batch, context, FP8 weights, FP8 KV): the offline run's steady batches
    "bf16": (560, 1536, False, False),
    "kv8": (862, 1536, False, True),
    "w8kv8": (862, 1536, True, True),
}


@dataclass
class Layer:
    weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]]  # name: (weight, scale)
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor


def make_layers(num_layers: int, batch: int, context: int, fp8_w: bool,
                kv_dtype: torch.dtype) -> tuple[list[Layer], torch.Tensor]:
    shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER)}
    slots = batch * context
    req_to_token = (torch.arange(slots, device="cuda", dtype=torch.int32)[torch.randperm(
        slots, device="cuda")] + 1).view(batch, context)
    layers = []
    for _ in range(num_layers):
        weights = {}
        for name, (n, k) in shapes.items():
            w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16) * 0.02
            if fp8_w:
                scale = w.abs().amax(dim=1, keepdim=True).float() / 448.0
                weights[name] = ((w / scale).to(torch.float8_e4m3fn), scale)
            else:
                weights[name] = (w, None)
        kv_shape = (slots + 1, NUM_KV_HEADS, HEAD_DIM)
        layers.append(Layer(weights,
                            torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16).to(kv_dtype),
                            torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16).to(kv_dtype)))
    return layers, req_to_token


class NanoBatch:
    """One slice of the batch: its rows, its requests and its buffers."""

    def __init__(self, rows: slice, req_to_token: torch.Tensor, context: int) -> None:
        self.m = rows.stop - rows.start
        self.x0 = torch.randn((self.m, HIDDEN), device="cuda", dtype=torch.bfloat16)
        self.x = self.x0
        self.req_pool_indices = torch.arange(rows.start, rows.stop, device="cuda")
        self.seq_lens = torch.full((self.m,), context, device="cuda", dtype=torch.int32)
        self.req_to_token = req_to_token
        self.q: torch.Tensor | None = None
        self.out = torch.empty((self.m, NUM_HEADS, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
        self.mid_out = torch.empty((self.m, NUM_HEADS, 1, HEAD_DIM), device="cuda")
        self.mid_lse = torch.empty((self.m, NUM_HEADS, 1), device="cuda")


def product(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    w, scale = weight
    if scale is None:
        return torch.nn.functional.linear(x, w)
    from radixserve.layers.kernels.fp8_gemm import scaled_mm_per_token
    return scaled_mm_per_token(x, w, scale, None)


def attention(nb: NanoBatch, layer: Layer) -> None:
    from radixserve.attention.kernels.decode_attention import (decode_attention_fwd,
                                                               default_decode_config)
    decode_attention_fwd(nb.q, layer.k_buffer, layer.v_buffer, nb.out, nb.req_to_token,
                         nb.req_pool_indices, nb.seq_lens, nb.mid_out, nb.mid_lse,
                         HEAD_DIM ** -0.5, default_decode_config(layer.k_buffer.dtype, 1))


def gemms_after(nb: NanoBatch, layer: Layer, next_layer: Layer) -> None:
    """o, gate|up, SiLU-mul, down of this layer, then the next layer's q|k|v."""
    from radixserve.layers.kernels.silu_and_mul import silu_and_mul
    h = product(nb.out.view(nb.m, HIDDEN), layer.weights["o"])
    h = product(silu_and_mul(product(h, layer.weights["gate_up"])), layer.weights["down"])
    nb.x = h
    qkv = product(h, next_layer.weights["qkv"])
    nb.q = qkv[:, :NUM_HEADS * HEAD_DIM].view(nb.m, NUM_HEADS, HEAD_DIM)


def first_qkv(nb: NanoBatch, layer: Layer) -> None:
    qkv = product(nb.x0, layer.weights["qkv"])
    nb.q = qkv[:, :NUM_HEADS * HEAD_DIM].view(nb.m, NUM_HEADS, HEAD_DIM)


def run_serial(nbs: list[NanoBatch], layers: list[Layer]) -> None:
    for nb in nbs:
        first_qkv(nb, layers[0])
        for i, layer in enumerate(layers):
            attention(nb, layer)
            gemms_after(nb, layer, layers[(i + 1) % len(layers)])


def run_pipelined(nbs: list[NanoBatch], layers: list[Layer], attn_stream: torch.cuda.Stream,
                  gemm_stream: torch.cuda.Stream) -> None:
    """Attention of one nano-batch on attn_stream while the other's GEMMs run on gemm_stream."""
    main = torch.cuda.current_stream()
    start = torch.cuda.Event()
    start.record(main)
    ready = {}  # nano-batch index: event after its last GEMM block
    with torch.cuda.stream(gemm_stream):
        gemm_stream.wait_event(start)
        for j, nb in enumerate(nbs):
            first_qkv(nb, layers[0])
            ready[j] = torch.cuda.Event()
            ready[j].record(gemm_stream)
    for i, layer in enumerate(layers):
        attended = {}
        for j, nb in enumerate(nbs):
            with torch.cuda.stream(attn_stream):
                attn_stream.wait_event(ready[j])
                attention(nb, layer)
                attended[j] = torch.cuda.Event()
                attended[j].record(attn_stream)
        for j, nb in enumerate(nbs):
            with torch.cuda.stream(gemm_stream):
                gemm_stream.wait_event(attended[j])
                gemms_after(nb, layer, layers[(i + 1) % len(layers)])
                ready[j] = torch.cuda.Event()
                ready[j].record(gemm_stream)
    for stream in (attn_stream, gemm_stream):
        done = torch.cuda.Event()
        done.record(stream)
        main.wait_event(done)


def time_ms(fn: Callable[[], None], reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return min(times)


def _on(stream: torch.cuda.Stream, fn: Callable[[], object]) -> None:
    """fn's kernels on stream, ordered after and before the current stream's work."""
    main = torch.cuda.current_stream()
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        fn()
    main.wait_stream(stream)


class _Driver:
    """Disjoint SM partitions as green contexts, each with a stream (CUDA driver API)."""

    RESOURCE_BYTES = 512  # CUdevResource is 144 bytes in CUDA 12.4-13; room to spare

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed: CUresult {result}")

    def split(self, gemm_sms: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream, int, int]:
        lib = self.lib
        device = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(device), torch.cuda.current_device()),
                    "cuDeviceGet")
        full = ctypes.create_string_buffer(self.RESOURCE_BYTES)
        self._check(lib.cuDeviceGetDevResource(device, full, 1), "cuDeviceGetDevResource")
        group = ctypes.create_string_buffer(self.RESOURCE_BYTES)
        rest = ctypes.create_string_buffer(self.RESOURCE_BYTES)
        groups = ctypes.c_uint(1)
        self._check(lib.cuDevSmResourceSplitByCount(group, ctypes.byref(groups), full, rest,
                                                    0, gemm_sms), "cuDevSmResourceSplitByCount")
        streams, counts = [], []
        for resource in (group, rest):
            counts.append(ctypes.c_uint.from_buffer(resource, 96).value)  # sm.smCount
            desc = ctypes.c_void_p()
            self._check(lib.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1),
                        "cuDevResourceGenerateDesc")
            green = ctypes.c_void_p()
            self._check(lib.cuGreenCtxCreate(ctypes.byref(green), desc, device, 1),
                        "cuGreenCtxCreate")
            stream = ctypes.c_void_p()
            self._check(lib.cuGreenCtxStreamCreate(ctypes.byref(stream), green, 1, 0),
                        "cuGreenCtxStreamCreate")
            streams.append(torch.cuda.ExternalStream(stream.value))
        return streams[0], streams[1], counts[0], counts[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--carve", type=int, nargs="*", default=[32, 66])
    parser.add_argument("--green", type=int, nargs="*", default=[32, 48, 64, 80])
    args = parser.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    green_streams = {}
    try:
        driver = _Driver()
        for g in args.green:
            green_streams[g] = driver.split(g)
    except (OSError, RuntimeError, AttributeError) as exc:
        print(f"green contexts unavailable: {exc}", flush=True)
    for name in args.cases:
        batch, context, fp8_w, fp8_kv = CASES[name]
        kv_dtype = torch.float8_e4m3fn if fp8_kv else torch.bfloat16
        layers, req_to_token = make_layers(args.layers, batch, context, fp8_w, kv_dtype)
        whole = [NanoBatch(slice(0, batch), req_to_token, context)]
        half = batch // 2
        halves = [NanoBatch(slice(0, half), req_to_token, context),
                  NanoBatch(slice(half, batch), req_to_token, context)]
        per_layer = 1.0 / args.layers
        results = {}
        first_qkv(whole[0], layers[0])
        results["attention alone"] = time_ms(lambda: [attention(whole[0], l) for l in layers])
        results["GEMMs alone"] = time_ms(
            lambda: [gemms_after(whole[0], l, l) for l in layers])
        results["serial"] = time_ms(lambda: run_serial(whole, layers))
        results["halves"] = time_ms(lambda: run_serial(halves, layers))
        s_attn, s_gemm = torch.cuda.Stream(), torch.cuda.Stream()
        results["streams"] = time_ms(lambda: run_pipelined(halves, layers, s_attn, s_gemm))
        for carve in args.carve:
            try:
                torch._C._set_sm_carveout_experimental(carve)
                results[f"carve {carve}"] = time_ms(
                    lambda: run_pipelined(halves, layers, s_attn, s_gemm))
            except (RuntimeError, TypeError) as exc:
                print(f"carve {carve}: {exc}", flush=True)
            finally:
                torch._C._set_sm_carveout_experimental(None)
        for g, (gemm_stream, attn_stream, n_gemm, n_attn) in green_streams.items():
            try:
                results[f"green {n_gemm} GEMM / {n_attn} attn"] = time_ms(
                    lambda: run_pipelined(halves, layers, attn_stream, gemm_stream))
                results[f"  attention alone on {n_attn}"] = time_ms(
                    lambda: _on(attn_stream, lambda: [attention(whole[0], l) for l in layers]))
                results[f"  GEMMs alone on {n_gemm}"] = time_ms(
                    lambda: _on(gemm_stream, lambda: [gemms_after(whole[0], l, l) for l in layers]))
            except RuntimeError as exc:
                print(f"green {g}: {exc}", flush=True)
                break
        serial = results["serial"]
        print(f"\n{name}: batch {batch}, context {context}, FP8 weights {fp8_w}, KV {kv_dtype}, "
              f"{sms} SMs, ms per layer", flush=True)
        for label, ms in results.items():
            print(f"  {label:32s} {ms * per_layer:7.3f}  ({serial / ms:.3f}x serial)", flush=True)
        # correctness of the pipelined order: the same outputs as serial halves
        run_serial(halves, layers)
        reference = [nb.x.clone() for nb in halves]
        run_pipelined(halves, layers, s_attn, s_gemm)
        torch.cuda.synchronize()
        diff = max((nb.x.float() - r.float()).abs().max().item() for nb, r in zip(halves, reference))
        print(f"  pipelined vs serial halves, max |diff| {diff:.3g}", flush=True)
        del layers, whole, halves
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
