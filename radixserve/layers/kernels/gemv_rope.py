"""Rope and the KV-cache store as the epilogue of a one-row q|k|v GEMV (kernels/gemv.py).

A batch-1 decode layer otherwise runs a kernel of its own between the q|k|v product and
attention: rope on q and k, and K/V written into the pool (mem/kernels/rope_kv_store.py). That
kernel's work is a few kilobytes; its cost is one more launch and wait in the chain of a step
that is latency-bound between its weight reads. Here the product's programs do it themselves.

Rope (neox layout, full width: rotary_dim == head_dim) pairs dim d of a head with dim d + D/2.
A program normally owns BLOCK_N consecutive output rows; with rope it owns BLOCK_N / 2 such
pairs of one head (rows d .. d + P - 1, then d + D/2 .. d + D/2 + P - 1), so both halves of
each pair end in the same program. Each row is still one weight row read whole, so the reads
are as before. Each row's sum is the same one (bitwise in the Triton interpreter; on the GPU the
compiler may lay out the reduction of the reordered rows differently, one unit in the last
place on 10-19% of the rows on the H200). The epilogue then rounds the rows to the activations'
dtype (what the q|k|v output holds), rotates q and k heads as HF rounds
`q * cos + rotate_half(q) * sin`, stores all rows to the output (q rotated, which attention
reads), and writes k (rotated) and v heads into the pool's slot, cast or quantised as the pool
stores them (`rope_kv_store.cache_value`).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixserve.mem.kernels.rope_kv_store import cache_value, kv_store_args, rotate_halves
from radixserve.mem.kv_pool import KVStoreTarget

# RADIXSERVE_GEMV_ROPE=0 keeps rope + the K/V store as a kernel of their own (for A/B timing)
ENABLED = os.environ.get("RADIXSERVE_GEMV_ROPE", "1") != "0"


class RopeStore(NamedTuple):
    """What a one-row q|k|v product carries: rope at positions[0] from the cos/sin caches
    ([max_position, head_dim], both halves equal), and this token's K/V stored at the target's
    slot loc[0]. The product's rows are num_q_heads q heads, then num_kv_heads k heads, then
    num_kv_heads v heads of head_dim each."""
    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    target: KVStoreTarget
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def rope_rows_fit(block_n: int, head_dim: int) -> bool:
    """Whether programs of block_n rows can own whole rope pairs of one head each."""
    pairs, half = block_n // 2, head_dim // 2
    return block_n % 2 == 0 and head_dim % 2 == 0 and pairs > 0 and half % pairs == 0


def check_rope_store(rope: RopeStore, n: int, block_n: int) -> None:
    """Asserts the product's shape and configuration match `rope`."""
    heads = rope.num_q_heads + 2 * rope.num_kv_heads
    assert n == heads * rope.head_dim, "rows must be the q, k and v heads"
    assert rope_rows_fit(block_n, rope.head_dim), f"block_n {block_n} splits a rope pair"
    assert rope.cos_cache.shape[1] == rope.head_dim, "rope must span the whole head"
    assert rope.cos_cache.stride(1) == 1 and rope.sin_cache.stride(1) == 1


def rope_launch_options(num_warps: int) -> dict:
    """Launch options capping a rope-carrying product's registers so that three programs of
    num_warps still fit per SM (65,536 registers, allocated per thread in steps of 8; at most
    255). Llama-3.1-8B's q|k|v GEMV (16 rows x 512, 8 warps, 384 programs) takes 80 registers
    plain: one wave of three programs per SM. The rope epilogue took it to 89-92, two per SM,
    and batch-1 decode from 4.09 to 4.20 ms (H200, bf16; FP8 weights 2.73 -> 2.85 ms); capped
    at 80 it compiles without spilling and the step runs in 4.07-4.08 ms (FP8 2.69-2.71)."""
    return {"maxnreg": min(255, 65536 // (3 * 32 * num_warps) // 8 * 8)}


def rope_kernel_args(rope: RopeStore | None, placeholder: torch.Tensor) -> dict:
    """The GEMV kernel's rope arguments (placeholders when there is no rope)."""
    if rope is None:
        return dict(Positions=placeholder, Cos=placeholder, Sin=placeholder,
                    KCache=placeholder, VCache=placeholder, Loc=placeholder, stride_cos=0,
                    stride_sin=0, stride_kc_slot=0, stride_kc_h=0, stride_vc_slot=0,
                    stride_vc_h=0, num_q_heads=0, num_kv_heads=0, k_scale_inv=1.0,
                    v_scale_inv=1.0, ROPE=False, HALF=1, QUANT=False, FP8_MAX=448.0)
    target = rope.target
    k_cache, v_cache = target.k_cache, target.v_cache
    return dict(Positions=rope.positions, Cos=rope.cos_cache, Sin=rope.sin_cache,
                KCache=k_cache, VCache=v_cache, Loc=target.loc,
                stride_cos=rope.cos_cache.stride(0), stride_sin=rope.sin_cache.stride(0),
                stride_kc_slot=k_cache.stride(0), stride_kc_h=k_cache.stride(1),
                stride_vc_slot=v_cache.stride(0), stride_vc_h=v_cache.stride(1),
                num_q_heads=rope.num_q_heads, num_kv_heads=rope.num_kv_heads, ROPE=True,
                HALF=rope.head_dim // 2,
                **kv_store_args(k_cache, v_cache, rope.num_kv_heads, rope.head_dim,
                                target.k_scale, target.v_scale))


@triton.jit
def rope_pair_rows(pid, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """Output rows of program pid: BLOCK_N // 2 rope pairs (d, d + HALF) of one head, the
    first halves' rows d, d + 1, ... then their partners' (each half consecutive, so a warp's
    rows stay consecutive as without rope)."""
    i = tl.arange(0, BLOCK_N)
    pair = pid * (BLOCK_N // 2) + i % (BLOCK_N // 2)
    return (pair // HALF) * (2 * HALF) + pair % HALF + (i // (BLOCK_N // 2)) * HALF


@triton.jit
def _halves(x, BLOCK_N: tl.constexpr):
    """Rows in `rope_pair_rows` order -> (first halves, partners), [BLOCK_N // 2] each."""
    return tl.split(tl.trans(tl.reshape(x, [2, BLOCK_N // 2])))


@triton.jit
def rope_store_epilogue(y, offs_n, Y, pos, Cos, Sin, Loc, stride_cos, stride_sin, KCache,
                        VCache, stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h,
                        num_q_heads, num_kv_heads, k_scale_inv, v_scale_inv,
                        BLOCK_N: tl.constexpr, HALF: tl.constexpr, QUANT: tl.constexpr,
                        FP8_MAX: tl.constexpr):
    """Rows y (float32 sums, rows offs_n from `rope_pair_rows`) rounded to Y's dtype, q and k
    heads rotated at position pos, stored to Y; k and v heads also to the caches' slot Loc[0].

    pos comes from the caller, loaded after its PDL wait; the cos/sin rows and the slot are
    loaded here. Loaded at the program's start, they held back the first weight tile: the
    compiler issued them, and the loads waiting on pos, before it."""
    dtype = Y.dtype.element_ty
    dims = offs_n % (2 * HALF)
    first_dims, _ = _halves(dims, BLOCK_N)  # each pair's d < HALF
    # rounded to the activations' dtype, as HF casts the cache before use
    cos = tl.load(Cos + pos * stride_cos + first_dims).to(dtype).to(tl.float32)
    sin = tl.load(Sin + pos * stride_sin + first_dims).to(dtype).to(tl.float32)
    slot = tl.load(Loc).to(tl.int64)
    rounded = y.to(dtype)
    x1, x2 = _halves(rounded.to(tl.float32), BLOCK_N)
    out1, out2 = rotate_halves(x1, x2, cos, sin, dtype)
    heads = offs_n // (2 * HALF)
    # v heads (past the q and k heads) pass unrotated
    out = tl.where(heads < num_q_heads + num_kv_heads,
                   tl.reshape(tl.trans(tl.join(out1, out2)), [BLOCK_N]), rounded)
    tl.store(Y + offs_n, out)
    kv_heads = heads - num_q_heads  # k heads 0..Hkv-1, then v heads Hkv..2Hkv-1
    is_k = (kv_heads >= 0) & (kv_heads < num_kv_heads)
    is_v = kv_heads >= num_kv_heads
    tl.store(KCache + slot * stride_kc_slot + kv_heads * stride_kc_h + dims,
             cache_value(out, k_scale_inv, QUANT, FP8_MAX, KCache), mask=is_k)
    tl.store(VCache + slot * stride_vc_slot + (kv_heads - num_kv_heads) * stride_vc_h + dims,
             cache_value(out, v_scale_inv, QUANT, FP8_MAX, VCache), mask=is_v)
