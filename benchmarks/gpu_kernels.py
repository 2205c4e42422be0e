"""Time the Triton attention kernels on a GPU at Llama-3.1-8B shapes (per TP rank of 1).

  python benchmarks/gpu_kernels.py            # the standard table
  python benchmarks/gpu_kernels.py --sweep    # also try other block sizes / split counts

Every figure is from CUDA-graph replay (no launch overhead, as decode runs when serving).
Decode: split-KV kernel over KV slots scattered at random in the pool (the worst case for
locality), over several layers' KV so reads come from HBM, not L2; reported per layer as bytes
of K+V read per second against the H200's ~4.25 TB/s copy rate.
Extend: causal prefill (and one prefill on a cached prefix), reported as TFLOP/s (two matmuls,
causal pairs only) against ~796 TFLOP/s dense bf16; torch SDPA on the same causal shape is
printed beside it as a baseline. Figures only; nothing here asserts on time.
"""
from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

PEAK_BANDWIDTH = 4.25e12  # bytes/s, device-to-device copy measured on an H200
PEAK_FLOPS = 796e12  # dense bf16 matmul measured on an H200
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16


@dataclass
class Pool:
    req_to_token: torch.Tensor
    k_buffers: list[torch.Tensor]  # one per layer
    v_buffers: list[torch.Tensor]
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor


def make_pool(seq_lens: list[int], num_layers: int = 1, kv_dtype: torch.dtype = DTYPE,
              contiguous: bool = False) -> Pool:
    """Slots at random in the pool, or (contiguous) each request's positions in one run, as a
    prompt prefilled in one pass gets them."""
    total = sum(seq_lens)
    slots = (torch.arange(total, device="cuda") if contiguous
             else torch.randperm(total, device="cuda")).int() + 1
    req_to_token = torch.zeros((len(seq_lens), max(seq_lens)), dtype=torch.int32, device="cuda")
    offset = 0
    for row, seq_len in enumerate(seq_lens):
        req_to_token[row, :seq_len] = slots[offset:offset + seq_len]
        offset += seq_len
    shape = (total + 1, NUM_KV_HEADS, HEAD_DIM)
    return Pool(req_to_token,
                [torch.randn(shape, dtype=DTYPE, device="cuda").to(kv_dtype)
                 for _ in range(num_layers)],
                [torch.randn(shape, dtype=DTYPE, device="cuda").to(kv_dtype)
                 for _ in range(num_layers)],
                torch.arange(len(seq_lens), device="cuda"),
                torch.tensor(seq_lens, device="cuda"))


def kv_splits_for(bs: int, num_kv_heads: int = NUM_KV_HEADS) -> int:
    """The split count TritonAttnBackend.num_kv_splits_for picks: about two programs per SM."""
    import triton
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, min(16, triton.next_power_of_2(triton.cdiv(2 * sms, bs * num_kv_heads))))


def time_graph(fn: Callable[[], None]) -> float:
    """Seconds per call, replayed from a CUDA graph (no launch overhead, as in serving)."""
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=50) * 1e-3


def decode_pool(bs: int, context: int, kv_dtype: torch.dtype, contiguous: bool) -> Pool:
    """bs requests of `context` positions over enough layers' KV (like a model step) that the
    data a pass over them reads is well past the 60 MB L2 cache."""
    layer_bytes = 2 * bs * context * NUM_KV_HEADS * HEAD_DIM * kv_dtype.itemsize
    num_layers = max(1, min(32, -(-(1 << 30) // layer_bytes)))
    return make_pool([context] * bs, num_layers, kv_dtype, contiguous)


def bench_decode(bs: int, context: int, num_kv_splits: int, config: object,
                 kv_dtype: torch.dtype = DTYPE, contiguous: bool = False) -> float:
    """Seconds per layer, over decode_pool's layers."""
    from radixserve.attention.kernels.decode_attention import decode_attention_fwd
    pool = decode_pool(bs, context, kv_dtype, contiguous)
    q = torch.randn((bs, NUM_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    mid_out = torch.empty((bs, NUM_HEADS, num_kv_splits, HEAD_DIM), device="cuda")
    mid_lse = torch.empty((bs, NUM_HEADS, num_kv_splits), device="cuda")

    def step() -> None:
        for k_buffer, v_buffer in zip(pool.k_buffers, pool.v_buffers):
            decode_attention_fwd(q, k_buffer, v_buffer, out, pool.req_to_token,
                                 pool.req_pool_indices, pool.seq_lens, mid_out, mid_lse,
                                 HEAD_DIM ** -0.5, config)
    return time_graph(step) / len(pool.k_buffers)


@functools.cache
def _gather_kernel() -> Any:
    """bench_gather's kernel, compiled once (triton is imported only when timing)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_kernel(K, V, Req_to_token, Seq_lens, Out, stride_kt, stride_req,
                      HEADS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        batch = tl.program_id(0)
        head = tl.program_id(1) * HEADS
        seq_len = tl.load(Seq_lens + batch).to(tl.int32)
        cols = tl.arange(0, HEADS * D)
        acc = tl.zeros([BLOCK_N, HEADS * D], dtype=tl.int8)
        for start in range(0, seq_len, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            mask = pos < seq_len
            slots = tl.load(Req_to_token + batch * stride_req + pos, mask=mask, other=0)
            offs = slots.to(tl.int64)[:, None] * stride_kt + head * D + cols[None, :]
            acc ^= tl.load(K + offs, mask=mask[:, None], other=0)
            acc ^= tl.load(V + offs, mask=mask[:, None], other=0)
        tl.store(Out + (batch * tl.num_programs(1) + tl.program_id(1)) * HEADS * D + cols,
                 tl.xor_sum(acc, 0))

    return gather_kernel


def bench_gather(bs: int, context: int, heads: int, kv_dtype: torch.dtype, block_n: int,
                 num_warps: int, num_stages: int, contiguous: bool = False) -> float:
    """Seconds per layer for only reading what decode attention reads (slot indices, then
    K and V rows of `heads` KV heads per program), xor-reduced so nothing is dropped: the rate
    this access pattern allows, without the attention's arithmetic."""
    kernel = _gather_kernel()
    pool = decode_pool(bs, context, kv_dtype, contiguous)
    # one byte lane per element (bf16 rows read as twice as many int8 columns)
    width = HEAD_DIM * kv_dtype.itemsize
    out = torch.empty((bs * NUM_KV_HEADS * width,), dtype=torch.int8, device="cuda")
    views = [(k.view(torch.int8), v.view(torch.int8))
             for k, v in zip(pool.k_buffers, pool.v_buffers)]

    def step() -> None:
        for k, v in views:
            kernel[(bs, NUM_KV_HEADS // heads)](
                k, v, pool.req_to_token, pool.seq_lens, out, k.stride(0),
                pool.req_to_token.stride(0), HEADS=heads, D=width,
                BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    return time_graph(step) / len(views)


def bench_extend(prefix_lens: list[int], extend_lens: list[int], config: object) -> float:
    from radixserve.attention.kernels.extend_attention import extend_attention_fwd
    pool = make_pool([p + e for p, e in zip(prefix_lens, extend_lens)])
    num_tokens = sum(extend_lens)
    q = torch.randn((num_tokens, NUM_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    k = torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    starts = torch.tensor([sum(extend_lens[:i]) for i in range(len(extend_lens))], device="cuda")
    ext = torch.tensor(extend_lens, device="cuda")
    pre = torch.tensor(prefix_lens, device="cuda")
    return time_graph(lambda: extend_attention_fwd(
        q, k, v, out, pool.k_buffers[0], pool.v_buffers[0], pool.req_to_token,
        pool.req_pool_indices, starts, ext, pre, max(extend_lens), HEAD_DIM ** -0.5, config))


def bench_sdpa_causal(bs: int, seq_len: int) -> float:
    q = torch.randn((bs, NUM_HEADS, seq_len, HEAD_DIM), dtype=DTYPE, device="cuda")
    k = torch.randn((bs, NUM_KV_HEADS, seq_len, HEAD_DIM), dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return time_graph(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True))


def bench_sdpa_prefix(prefix_len: int, extend_len: int) -> dict[str, float]:
    """Vendor attention for one chunk over a long cached prefix, with the prefix K/V gathered
    out of the pool into contiguous tensors first (the gather is timed too): torch's flash
    path through a lower-right causal bias, and cuDNN in two calls (prefix without mask, chunk
    causal) merged by their log-sum-exps. Each variant that the installed torch cannot run is
    left out."""
    from torch.nn.attention.bias import causal_lower_right
    total = prefix_len + extend_len
    pool = make_pool([total])
    rows = pool.req_to_token[0, :prefix_len].long()
    q = torch.randn((1, NUM_HEADS, extend_len, HEAD_DIM), dtype=DTYPE, device="cuda")
    k_new = torch.randn((1, NUM_KV_HEADS, extend_len, HEAD_DIM), dtype=DTYPE, device="cuda")
    v_new = torch.randn_like(k_new)
    group = NUM_HEADS // NUM_KV_HEADS
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def gathered() -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat((pool.k_buffers[0].index_select(0, rows).transpose(0, 1)[None], k_new), 2)
        v = torch.cat((pool.v_buffers[0].index_select(0, rows).transpose(0, 1)[None], v_new), 2)
        return k, v

    def flash_lower_right() -> None:
        k, v = gathered()
        sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
             causal_lower_right(extend_len, total))

    def cudnn_two_part() -> None:
        k, v = gathered()
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
        cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
        out_p, lse_p = cudnn(q, k[:, :, :prefix_len], v[:, :, :prefix_len], None, True)[:2]
        out_c, lse_c = cudnn(q, k[:, :, prefix_len:], v[:, :, prefix_len:], None, True, 0.0,
                             True)[:2]
        shape = (1, NUM_HEADS, extend_len, 1)
        lse_p, lse_c = lse_p.reshape(shape), lse_c.reshape(shape)
        lse = torch.logaddexp(lse_p, lse_c)
        _ = out_p * torch.exp(lse_p - lse) + out_c * torch.exp(lse_c - lse)

    results = {"gather K/V only": time_graph(lambda: gathered())}
    for name, fn in (("flash lower-right + gather", flash_lower_right),
                     ("cuDNN 2-part + gather", cudnn_two_part)):
        try:
            fn()
            torch.cuda.synchronize()
            results[name] = time_graph(fn)
        except Exception as exc:  # a backend this torch lacks: say so, go on
            print(f"   {name}: not run ({type(exc).__name__}: {str(exc)[:120]})")
    return results


def decode_report(bs: int, context: int, seconds: float, label: str,
                  kv_dtype: torch.dtype = DTYPE) -> str:
    kv_bytes = 2 * bs * context * NUM_KV_HEADS * HEAD_DIM * kv_dtype.itemsize
    flops = 4 * bs * NUM_HEADS * context * HEAD_DIM
    bandwidth = kv_bytes / seconds
    return (f"decode bs={bs:<4} ctx={context:<5} {label:<24} {seconds * 1e6:9.1f} us  "
            f"{bandwidth / 1e12:5.2f} TB/s ({100 * bandwidth / PEAK_BANDWIDTH:4.1f}% of 4.25)  "
            f"{flops / seconds / 1e12:6.1f} TFLOP/s")


def extend_flops(prefix_lens: list[int], extend_lens: list[int]) -> float:
    pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix_lens, extend_lens))
    return 4.0 * NUM_HEADS * HEAD_DIM * pairs


def extend_report(name: str, flops: float, seconds: float, label: str) -> str:
    return (f"extend {name:<22} {label:<26} {seconds * 1e6:9.1f} us  "
            f"{flops / seconds / 1e12:6.1f} TFLOP/s ({100 * flops / seconds / PEAK_FLOPS:4.1f}%"
            f" of 796)")


# decode --fp8: the sweep's configs (DecodeKernelConfig's fields in order: block_n, num_warps,
# num_stages, early_v[, max_registers[, lazy_rescale[, early_kv]]]),
# in groups that --fp8-groups names
FP8_SWEEP: dict[str, tuple[tuple, ...]] = {
    "wide": ((128, 4, 2), (128, 4, 3), (128, 8, 2), (64, 4, 3), (64, 4, 4), (64, 2, 4),
             (64, 2, 3, True), (128, 4, 2, True), (64, 4, 3, True)),
    # smaller K/V tiles: two warps with 64-position tiles took 246 registers per thread and
    # fit 4 programs (8 warps) per SM (Nsight Compute, session 13)
    "small_tiles": ((32, 2, 3, True), (32, 2, 4, True), (32, 2, 5, True), (16, 2, 6, True),
                    (32, 4, 4, True)),
    # one warp per program: more programs, each with its own loads in flight (session 14:
    # n32w1s4 read 3.63 TB/s at batch 862 where the two-warp default read 3.12)
    "one_warp": ((32, 1, 3, True), (32, 1, 4, True), (32, 1, 5, True), (32, 1, 6, True),
                 (64, 1, 3, True), (64, 1, 4, True), (16, 1, 4, True), (16, 1, 6, True),
                 (16, 1, 8, True), (32, 1, 4, False), (64, 2, 3, True)),
    # where one split begins (batch 33 up runs one split): the two defaults and their kin
    "split_boundary": ((64, 2, 3, True), (32, 1, 4, True), (32, 1, 5, True), (16, 1, 6, True)),
    # a stale running max, rescaled only when a block passes it by 2^8 (session 14)
    "lazy": ((64, 2, 3, True, 0, True), (32, 1, 5, True, 0, True), (32, 1, 4, True, 0, True),
             (16, 1, 6, True, 0, True)),
    # each split's first block gathered before the PDL wait (session 15: one split, batch 256
    # 225.8 vs 233.8 us, 862 equal), and with the lazy max (also ~3% at 256 alone; untimed)
    "early_kv": ((64, 2, 3, True, 0, False, True), (32, 1, 5, True, 0, False, True),
                 (32, 1, 5, True, 0, True, True)),
    # register caps (Triton's maxnreg) for more programs per SM
    "capped": ((64, 2, 3, True, 168), (64, 2, 4, True, 168), (64, 2, 3, True, 128),
               (32, 2, 4, True, 128), (32, 1, 4, True, 168), (32, 1, 3, True, 200)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="try other configs too")
    parser.add_argument("--only", choices=["decode", "extend"], help="time one kernel only")
    parser.add_argument("--small", action="store_true",
                        help="decode: batch 1-16 at context 1024 (the decode-step regimes), "
                             "with a wider config and split sweep")
    parser.add_argument("--fp8", action="store_true",
                        help="decode: an FP8 (e4m3) KV pool at batch 256 and 862, context 1536 "
                             "(the FP8 offline run's regime), with an FP8 config sweep")
    parser.add_argument("--fp8-batches", type=int, nargs="+", default=[256, 862],
                        help="decode --fp8: the batch sizes (context 1536)")
    parser.add_argument("--fp8-groups", nargs="+", choices=sorted(FP8_SWEEP), default=None,
                        help="decode --fp8: time the FP8 default and these groups of the "
                             "sweep only (default: every group)")
    parser.add_argument("--contiguous", action="store_true",
                        help="decode: each request's KV slots in one run (a prompt prefilled "
                             "in one pass) instead of scattered at random")
    parser.add_argument("--gather", action="store_true",
                        help="decode --fp8: also the rate of only reading K/V in the same "
                             "pattern (1, 2, 4 KV heads per program), FP8 and bf16")
    parser.add_argument("--long", action="store_true",
                        help="extend: also 8,192-token chunks on 24K / 56K / 120K-token prefixes "
                             "(chunked prefill of a long prompt)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_kernels.py needs a CUDA GPU (none found); nothing was timed.")
    import triton

    from benchmarks.decode_config_pick import config_label
    from radixserve.attention.kernels.decode_attention import (DecodeKernelConfig,
                                                               default_decode_config)
    from radixserve.attention.kernels.extend_attention import (ExtendKernelConfig,
                                                               default_extend_config)
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"Llama-3.1-8B attention: {NUM_HEADS} q heads, {NUM_KV_HEADS} kv heads, "
          f"head_dim {HEAD_DIM}, {DTYPE}")

    decode_configs: list[DecodeKernelConfig | None] = [None]  # None: the default (per split plan)
    if args.sweep:
        decode_configs += [DecodeKernelConfig(*c) for c in (
            (32, 4, 2), (64, 4, 3), (128, 4, 2), (32, 2, 3), (64, 2, 2))]
    decode_cases = [(bs, c) for bs in (1, 32, 128) for c in (1024, 4096)]
    if args.small:
        decode_cases = [(bs, 1024) for bs in (1, 4, 8, 16)]
        decode_configs += [DecodeKernelConfig(*c) for c in (
            (32, 2, 2), (64, 4, 2), (64, 2, 3, True), (128, 4, 2, True), (32, 2, 2, True),
            (64, 4, 2, True), (64, 2, 2, True), (32, 1, 4), (32, 1, 4, True), (64, 1, 3),
            (16, 1, 4), (64, 2, 3, False, 0, True), (64, 2, 3, True, 0, True),
            (64, 2, 3, False, 0, True, True), (64, 2, 3, True, 0, True, True))]
    kv_dtype = DTYPE
    if args.fp8:
        kv_dtype = torch.float8_e4m3fn
        decode_cases = [(bs, 1536) for bs in args.fp8_batches]
        groups = args.fp8_groups or list(FP8_SWEEP)
        decode_configs = [None] + [  # None: the default for the case's split plan
            DecodeKernelConfig(*c) for group in groups for c in FP8_SWEEP[group]]
    for bs, context in decode_cases if args.only != "extend" else ():
        plan = kv_splits_for(bs)
        split_choices = sorted({plan, 1, 2, 4, 8, 16, 32, 64}) if args.sweep else [plan]
        for listed in decode_configs:
            for splits in split_choices:
                config = listed or default_decode_config(kv_dtype, splits)
                try:
                    seconds = bench_decode(bs, context, splits, config, kv_dtype,
                                           args.contiguous)
                except Exception as exc:  # a config that does not compile (registers, smem)
                    print(f"   {config}: not run ({type(exc).__name__}: {str(exc)[:100]})")
                    continue
                label = f"splits={splits}{'*' if splits == plan else ''} {config_label(config)}"
                print(decode_report(bs, context, seconds, label, kv_dtype))
        if args.gather and args.fp8:
            for gather_dtype in (kv_dtype, DTYPE):
                for heads, block_n, warps, stages in ((1, 64, 2, 3), (2, 64, 4, 3),
                                                      (4, 32, 4, 3), (4, 64, 8, 3)):
                    try:
                        seconds = bench_gather(bs, context, heads, gather_dtype, block_n, warps,
                                               stages, args.contiguous)
                    except Exception as exc:
                        print(f"   gather h{heads}: not run ({type(exc).__name__}: "
                              f"{str(exc)[:100]})")
                        continue
                    print(decode_report(bs, context, seconds,
                                        f"gather only h{heads} n{block_n}w{warps}s{stages}",
                                        gather_dtype))


    cases = {"1x4096": ([0], [4096]), "8x1024": ([0] * 8, [1024] * 8),
             "1x512 on 3584 prefix": ([3584], [512])}
    if args.long:
        cases.update({f"1x8192 on {p // 1024}K prefix": ([p], [8192])
                      for p in (24576, 57344, 122880)})
    extend_configs = [default_extend_config(HEAD_DIM)]
    if args.sweep:
        extend_configs += [ExtendKernelConfig(*c) for c in (
            (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 32, 4, 3), (128, 128, 8, 2),
            (128, 32, 4, 3))]
    for name, (prefix_lens, extend_lens) in cases.items() if args.only != "decode" else ():
        flops = extend_flops(prefix_lens, extend_lens)
        for c in extend_configs:
            seconds = bench_extend(prefix_lens, extend_lens, c)
            label = f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}"
            print(extend_report(name, flops, seconds, label))
        if len(prefix_lens) == 1 and prefix_lens[0] >= 16384:
            for label, seconds in bench_sdpa_prefix(prefix_lens[0], extend_lens[0]).items():
                print(extend_report(name, flops, seconds, label))
        if not any(prefix_lens) and len(set(extend_lens)) == 1:
            seconds = bench_sdpa_causal(len(extend_lens), extend_lens[0])
            print(extend_report(name, flops, seconds, "torch SDPA (baseline)"))


if __name__ == "__main__":
    main()
