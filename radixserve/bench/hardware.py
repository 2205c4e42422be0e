"""Roofline arithmetic: how long a forward pass must take at the least, on a given device.

A step's lower bound is max(bytes_moved / memory_bandwidth, flops / peak_flops). Bytes moved
are the weights read once (every linear layer and the LM head; the embedding table is only
gathered, a few rows per token) plus the KV cache read by attention and written for the new
tokens; activations are ignored. FLOPs are 2 per weight per token for the linear layers (the LM
head only for tokens whose logits are needed) plus attention's QK^T and PV products,
4 * heads * head_dim per key attended to, per layer, per token.

Peaks: the H200 defaults (4.25e12 B/s, 796e12 FLOP/s bf16) were measured on the lent machine;
any other device is measured here with a large copy and a large matmul. Flags override both.
`radixserve bench hardware` (or `python -m radixserve.bench.hardware`) prints the peaks of this
machine.

The FLOP peaks are bursts, from an idle GPU at its top clock. Under a load that lasts more than
a second or two an H200 sits at its 700 W limit and lowers its clock: bf16 matmuls back to back
hold 664.7e12 FLOP/s at ~1,440 MHz (FP8 `_scaled_mm` with fast accumulation 1,294.5e12
against 1,552e12 at the full clock; an FP8 product reaches the limit within a 50 ms burst).
`DevicePeak.sustained()` gives the peaks at the power limit where they are known, so a long
run's limit can be stated against both (`bench offline` prints both ratios).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from radixserve.bench.cli_support import BenchError, run_command
from radixserve.bench.param_counts import (ParamCounts, attended_keys, attention_flops_per_key,
                                           param_counts, recurrent_state_bytes)
from radixserve.core.model_config import ModelConfig

__all__ = ["ParamCounts", "param_counts", "attention_flops_per_key"]

H200_MEM_BANDWIDTH = 4.25e12  # bytes/s
H200_BF16_FLOPS = 796e12  # dense FLOP/s
# torch._scaled_mm, 8192^3, row-wise scales, fast accumulation (as the FP8 linears run since
# session 21), at the full clock: a graph of ~4 ms replayed after two idle seconds
# (benchmarks/gpu_peaks.py --full-clock, session 22; 1,504 at gate_up's shape at 896 rows). A
# 50 ms burst of the 8192^3 product already meets the power limit (1,287-1,304), unlike bf16's,
# whose full-clock rate (794) is its burst figure
H200_FP8_FLOPS = 1552e12
# the same matmuls back to back for 20-60 s, the board held at its 700 W limit
# (benchmarks/gpu_peaks.py --sustain, sessions 19 and 21): what a long compute-bound phase can get
H200_BF16_FLOPS_AT_POWER_LIMIT = 664.7e12
H200_FP8_FLOPS_AT_POWER_LIMIT = 1294.5e12

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else _DTYPES[dtype.replace("torch.", "")]


def dtype_bytes(dtype: torch.dtype | str) -> int:
    return torch.tensor([], dtype=as_dtype(dtype)).element_size()


def weight_bytes_per_forward(cfg: ModelConfig, dtype: torch.dtype | str,
                             num_tokens: int | None = None,
                             linear_dtype: torch.dtype | float | None = None) -> float:
    """Every weight read once per forward pass, except the embedding table (LM head included).
    MoE with `num_tokens` given: of each MoE layer's routed experts only the ones those tokens
    use (counts.distinct_experts, uniform routing). `linear_dtype` (FP8 weights; a float:
    bytes per weight, int4's with its scales): the decoder layers' linear weights at that size,
    the rest (norms, LM head) at `dtype`."""
    counts = param_counts(cfg)
    linear = float(counts.linear)
    if counts.num_experts and num_tokens is not None:
        unused = counts.num_experts - counts.distinct_experts(num_tokens)
        linear -= counts.moe_layers * unused * counts.routed_expert
    other = counts.layers - counts.linear + counts.final_norm + counts.lm_head
    if isinstance(linear_dtype, float):
        linear_size = linear_dtype
    else:
        linear_size = dtype_bytes(linear_dtype if linear_dtype is not None else dtype)
    return float(int(linear) * linear_size + other * dtype_bytes(dtype))


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype | str,
                       kv_dtype: torch.dtype | None = None) -> int:
    """The KV of one token in all layers, as the model's KV pool class counts it (stored as
    `kv_dtype` when given: FP8)."""
    import dataclasses

    from radixserve.mem.kv_pool import spec_bytes_per_token
    from radixserve.models.registry import kv_cache_spec
    spec = dataclasses.replace(kv_cache_spec(cfg, as_dtype(dtype)), storage_dtype=kv_dtype)
    return spec_bytes_per_token(spec)


def decode_step_bytes(cfg: ModelConfig, batch: int, context: float,
                      dtype: torch.dtype | str, linear_dtype: torch.dtype | float | None = None,
                      kv_dtype: torch.dtype | None = None) -> float:
    """One decode step of `batch` sequences that each attend to `context` tokens (the new one
    included; in windowed or chunked layers only the keys they see, `attended_keys`):
    weights + KV read of batch x context tokens + KV written for batch tokens (+ a hybrid
    model's recurrent states, read and written once per sequence).
    linear_dtype / kv_dtype: FP8 weights / KV cache."""
    kv = kv_bytes_per_token(cfg, dtype, kv_dtype)
    states = 2 * batch * recurrent_state_bytes(cfg, as_dtype(dtype).itemsize)
    return weight_bytes_per_forward(cfg, dtype, batch, linear_dtype) + \
        batch * attended_keys(cfg, context) * kv + batch * kv + states


def prefill_bytes(cfg: ModelConfig, batch: int, input_len: int,
                  dtype: torch.dtype | str) -> float:
    """Prefill of `batch` fresh prompts: weights + KV written and read back once."""
    kv = kv_bytes_per_token(cfg, dtype)
    return weight_bytes_per_forward(cfg, dtype) + 2 * batch * input_len * kv


def forward_flops(cfg: ModelConfig, num_tokens: int, context: float,
                  num_logits: int | None = None, decode: bool = False) -> float:
    """FLOPs of one forward pass over `num_tokens` tokens that each attend to `context` keys
    on average; the LM head runs on `num_logits` tokens (default: all of them). Linear FLOPs
    count each token's active weights (MoE: its top-k experts); `decode` selects MLA's absorbed
    attention."""
    return sum(forward_flops_split(cfg, num_tokens, context, num_logits, decode))


def forward_flops_split(cfg: ModelConfig, num_tokens: int, context: float,
                        num_logits: int | None = None, decode: bool = False
                        ) -> tuple[float, float]:
    """forward_flops as (decoder linear layers, the rest: LM head and attention): with FP8
    weights only the first run on the FP8 tensor cores."""
    counts = param_counts(cfg)
    logits = num_tokens if num_logits is None else num_logits
    attention = attention_flops_per_key(cfg, absorbed=decode) * context
    return (2.0 * counts.active_linear * num_tokens,
            2.0 * counts.lm_head * logits + attention * num_tokens)


def prefill_flops(cfg: ModelConfig, batch: int, input_len: int) -> float:
    """Causal prefill: token i attends to i + 1 keys, (input_len + 1) / 2 on average; logits
    only for each prompt's last token."""
    return sum(prefill_flops_split(cfg, batch, input_len))


def prefill_flops_split(cfg: ModelConfig, batch: int, input_len: int) -> tuple[float, float]:
    return forward_flops_split(cfg, batch * input_len, (input_len + 1) / 2, num_logits=batch)


def workload_limit_seconds(cfg: ModelConfig, prompt_lens: list[int], output_lens: list[int],
                           dtype: torch.dtype | str, peak: "DevicePeak",
                           kv_dtype: torch.dtype | None = None,
                           fp8_linears: bool = False) -> float:
    """The least time a whole offline workload can take: every FLOP at the peak rate plus every
    KV byte decode must read at the peak bandwidth.

    The two are added, not maxed: in a decode step the linear layers (compute bound once a few
    hundred requests run together) and attention over the KV cache (memory bound) are separate
    kernels, one after the other. FLOPs: each prompt's prefill, and one forward token per output
    token after the first (which prefill produced). Bytes: each decoded token reads its whole
    context's K/V. Weight reads are left out (shared by the whole batch, small beside the KV at
    serving batch sizes), so the limit is optimistic for small batches. No prefix sharing.
    fp8_linears: the decoder's linear layers run at peak.fp8_flops (FP8 weights), the LM head
    and attention at peak.peak_flops."""
    linear_flops = other_flops = 0.0
    kv_bytes = 0.0
    kv = kv_bytes_per_token(cfg, dtype, kv_dtype)
    for n_in, n_out in zip(prompt_lens, output_lens):
        linear, other = prefill_flops_split(cfg, 1, n_in)
        steps = max(n_out - 1, 0)  # decode steps; step j attends to n_in + j + 1 keys
        mean_context = n_in + (steps + 1) / 2 if steps else 0.0
        decode_linear, decode_other = forward_flops_split(cfg, steps, mean_context, decode=True)
        linear_flops += linear + decode_linear
        other_flops += other + decode_other
        kv_bytes += steps * mean_context * kv
    linear_peak = peak.fp8_flops if fp8_linears and peak.fp8_flops else peak.peak_flops
    return (linear_flops / linear_peak + other_flops / peak.peak_flops
            + kv_bytes / peak.mem_bandwidth)


@dataclass
class DevicePeak:
    name: str
    mem_bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s in the dtype used
    source: str  # where the figures came from
    fp8_flops: float | None = None  # FP8 x FP8 FLOP/s (H200 figure, flag, or None: unknown)
    # the FLOP/s the device holds at its power limit under a long load (None: unknown)
    sustained_flops: float | None = None
    sustained_fp8_flops: float | None = None

    def times(self, n: int) -> "DevicePeak":
        """The peaks of n such devices working together (tensor parallelism)."""
        def scaled(value: float | None) -> float | None:
            return None if value is None else value * n
        return DevicePeak(self.name, self.mem_bandwidth * n, self.peak_flops * n,
                          f"{self.source}, x{n}", scaled(self.fp8_flops),
                          scaled(self.sustained_flops), scaled(self.sustained_fp8_flops))

    def sustained(self) -> "DevicePeak | None":
        """These peaks with the FLOP/s held at the power limit in place of the bursts (the
        bandwidth unchanged); None when the sustained rate of the model dtype is unknown."""
        if self.sustained_flops is None:
            return None
        fp8 = self.sustained_fp8_flops if self.sustained_fp8_flops is not None \
            else self.fp8_flops
        return DevicePeak(self.name, self.mem_bandwidth, self.sustained_flops,
                          f"{self.source}, sustained", fp8)


class Roofline(NamedTuple):
    seconds: float  # the lower bound on the step time
    bound: str  # "memory" or "compute"


def roofline(bytes_moved: float, flops: float, peak: DevicePeak) -> Roofline:
    memory_s = bytes_moved / peak.mem_bandwidth
    compute_s = flops / peak.peak_flops
    return Roofline(max(memory_s, compute_s), "memory" if memory_s >= compute_s else "compute")


def _best_seconds(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of a large device-to-device copy (each byte read once and written once)."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (128 << 20))
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, repeats)
    return 2.0 * src.numel() * 4 / seconds


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int | None = None,
                         repeats: int = 3) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b), device, repeats)
    return 2.0 * n ** 3 / seconds


def device_peak(device: torch.device | str, dtype: torch.dtype | str,
                bandwidth: float | None = None, peak_flops: float | None = None,
                fp8_flops: float | None = None,
                sustained_flops: float | None = None) -> DevicePeak:
    """Flag values when given; the H200 defaults on an H200 (bf16/fp16); else measured (the
    FP8 peak is not measured here: benchmarks/gpu_peaks.py does it on a GPU). The sustained
    rates: the flag, else the H200's at its power limit (bf16/fp16) when its burst figure was
    not flagged either, else unknown (the FP8 one then falls back to the FP8 peak)."""
    device, dtype = torch.device(device), as_dtype(dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sources: list[str] = []
    is_h200 = "H200" in name
    if bandwidth is None:
        bandwidth = H200_MEM_BANDWIDTH if is_h200 else measure_bandwidth(device)
        sources.append("bandwidth: H200 default" if is_h200 else "bandwidth: measured")
    else:
        sources.append("bandwidth: flag")
    half = dtype in (torch.bfloat16, torch.float16)
    # the H200's rates at its power limit go with its burst figures, not with flagged ones
    h200_sustained = is_h200 and half and peak_flops is None
    h200_sustained_fp8 = is_h200 and fp8_flops is None
    if peak_flops is None:
        peak_flops = H200_BF16_FLOPS if is_h200 and half else measure_matmul_flops(device, dtype)
        sources.append("flops: H200 default" if is_h200 and half else "flops: measured")
    else:
        sources.append("flops: flag")
    fp8 = fp8_flops if fp8_flops is not None else (H200_FP8_FLOPS if is_h200 else None)
    if sustained_flops is None and h200_sustained:
        sustained_flops = H200_BF16_FLOPS_AT_POWER_LIMIT
    sustained_fp8 = H200_FP8_FLOPS_AT_POWER_LIMIT if h200_sustained_fp8 else None
    return DevicePeak(name, float(bandwidth), float(peak_flops), ", ".join(sources),
                      None if fp8 is None else float(fp8),
                      None if sustained_flops is None else float(sustained_flops),
                      sustained_fp8)


def add_peak_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="memory bandwidth in bytes/s (default: H200 figure or measured)")
    parser.add_argument("--peak-flops", type=float, default=None,
                        help="peak FLOP/s in the model dtype (default: H200 figure or measured)")
    parser.add_argument("--fp8-peak-flops", type=float, default=None,
                        help="FP8 FLOP/s for limits with FP8 weights (default: the H200 figure "
                             "on an H200, else the model dtype's peak)")
    parser.add_argument("--sustained-peak-flops", type=float, default=None,
                        help="FLOP/s in the model dtype held at the power limit under a long "
                             "load, for a second limit (default: the H200 figure on an H200 "
                             "without --peak-flops, else none)")


def available_device(name: str) -> str:
    """A torch device name this machine has (argparse type)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name}: this machine has no CUDA device")
    return name


def load_model_config(path: str) -> ModelConfig:
    if not os.path.isdir(path):
        raise BenchError(f"--model-path {path}: no such directory")
    try:
        return ModelConfig.from_path(path)
    except (OSError, ValueError) as exc:
        raise BenchError(f"--model-path {path}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixserve bench hardware", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=available_device,
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--model-path", default=None, help="a directory with config.json")
    add_peak_args(parser)
    args = parser.parse_args(argv)
    return run_command(lambda: print_peaks(args))


def print_peaks(args: argparse.Namespace) -> int:
    cfg = load_model_config(args.model_path) if args.model_path else None
    peak = device_peak(args.device, args.dtype, args.bandwidth, args.peak_flops,
                       args.fp8_peak_flops, args.sustained_peak_flops)
    print(f"device {peak.name}: {peak.mem_bandwidth / 1e9:.1f} GB/s, "
          f"{peak.peak_flops / 1e12:.2f} TFLOP/s {args.dtype} ({peak.source})")
    if peak.sustained_flops is not None:
        print(f"at the power limit under a long load: {peak.sustained_flops / 1e12:.2f} TFLOP/s")
    if cfg is not None:
        counts = param_counts(cfg)
        weights = weight_bytes_per_forward(cfg, args.dtype)
        print(f"model: {counts.total / 1e9:.3f} B params, {weights / 1e9:.2f} GB read per step, "
              f"KV {kv_bytes_per_token(cfg, args.dtype)} B/token; decode floor at batch 1: "
              f"{weights / peak.mem_bandwidth * 1e3:.3f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
