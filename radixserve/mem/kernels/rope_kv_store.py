"""Rotary position embedding (neox / HF Llama rotate_half layout), applied in place, in Triton.

Layout: q is [T, Hq * head_dim] (or [T, Hq, head_dim]), k likewise with Hk heads; the last dim
of each head must be contiguous, rows may be strided (q and k may be views into one qkv tensor).
cos_cache / sin_cache are [max_position, rot_dim] with both halves equal (cat(freqs, freqs)), as
HF builds them; rot_dim <= head_dim and dims past rot_dim are left alone (partial rotary).
Within the rotated dims, with x1 / x2 the first / second half:
  out1 = x1 * cos - x2 * sin,   out2 = x2 * cos + x1 * sin.
Rounding follows HF's `q * cos + rotate_half(q) * sin` in the activation dtype: cos/sin are
rounded to it, each product is rounded, then the sum.

`apply_rotary_and_store_kv` is the same kernel with the KV-cache store fused in: each token's
program also writes its rotated k heads and its v heads into the pool slot `loc[token]` (cast to
the pool's dtype), which saves the attention backend two index_put launches per layer; with
`qk_norm` each q and k head is RMS-normed first (Qwen3's q_norm / k_norm), which saves two more.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue


@triton.jit
def _rotate_heads(X, row_offset, stride_h, cos, sin, num_heads,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  NORM: tl.constexpr = False, NormW=None, eps=0.0):
    """Rotate the first 2 * HALF dims of num_heads heads in place; returns the two rotated
    halves ([BLOCK_H, BLOCK_HALF] each) in X's dtype. NORM (whole heads rotated): each head
    is RMS-normed first, weight NormW [2 * HALF], rounded as layers/kernels/rmsnorm.py rounds
    (the normed value in X's dtype, then times the weight, rounded again)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    mask = (offs_h[:, None] < num_heads) & d_mask[None, :]
    ptr1 = X + row_offset + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if NORM:
        variance = (tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * HALF)
        inv_rms = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(NormW + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(NormW + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        x1f = ((x1f * inv_rms).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        x2f = ((x2f * inv_rms).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    out1, out2 = rotate_halves(x1f, x2f, cos[None, :], sin[None, :], x1.dtype)
    tl.store(ptr1, out1, mask=mask)
    tl.store(ptr1 + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def rotate_halves(x1, x2, cos, sin, dtype: tl.constexpr):
    """The rotated halves (x1 cos - x2 sin, x2 cos + x1 sin) in `dtype`, each product and the
    sum rounded to it as HF's `q * cos + rotate_half(q) * sin` rounds them; x1, x2 are float32
    values of `dtype`, cos and sin float32 values already rounded to it."""
    x1_cos = (x1 * cos).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin).to(dtype).to(tl.float32)
    return (x1_cos - x2_sin).to(dtype), (x2_cos + x1_sin).to(dtype)


@triton.jit
def cache_value(x, scale_inv, QUANT: tl.constexpr, FP8_MAX: tl.constexpr, Cache):
    """A value as the cache holds it: cast, or (FP8) divided by the scale and saturated."""
    if QUANT:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * scale_inv, -FP8_MAX), FP8_MAX)
    return x.to(Cache.dtype.element_ty)


@triton.jit
def _rotary_kernel(Positions, Q, K, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_cos, stride_sin, num_q_heads, num_k_heads,
                   V, KCache, VCache, Loc, stride_vt, stride_vh, stride_kc_slot, stride_kc_h,
                   stride_vc_slot, stride_vc_h,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   STORE_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   TAIL: tl.constexpr, BLOCK_TAIL: tl.constexpr, USE_PDL: tl.constexpr,
                   k_scale_inv=1.0, v_scale_inv=1.0, QUANT: tl.constexpr = False,
                   FP8_MAX: tl.constexpr = 448.0, QK_NORM: tl.constexpr = False,
                   QNormW=None, KNormW=None, norm_eps=0.0):
    """One program per token. With STORE_KV, the rotated k heads and the v heads of the token
    also go to KCache[Loc[token]] / VCache[Loc[token]] ([slots, Hk, HEAD_DIM] each); the dims
    past the rotated ones (TAIL = HEAD_DIM - 2 * HALF of them) are copied unchanged. QK_NORM
    (TAIL 0): q and k heads RMS-normed (QNormW / KNormW, norm_eps) before they are rotated."""
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(Cos + pos * stride_cos + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(Sin + pos * stride_sin + offs_d, mask=d_mask, other=0.0)
    # rounded to the activations' dtype, as HF casts the cache before use
    cos = cos.to(Q.dtype.element_ty).to(tl.float32)
    sin = sin.to(Q.dtype.element_ty).to(tl.float32)
    _rotate_heads(Q, token * stride_qt, stride_qh, cos, sin, num_q_heads,
                  HALF, BLOCK_HQ, BLOCK_HALF, QK_NORM, QNormW, norm_eps)
    k1, k2 = _rotate_heads(K, token * stride_kt, stride_kh, cos, sin, num_k_heads,
                           HALF, BLOCK_HK, BLOCK_HALF, QK_NORM, KNormW, norm_eps)
    if STORE_KV:
        slot = tl.load(Loc + token).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_HK)
        h_mask = offs_h[:, None] < num_k_heads
        # rotated halves of k, cast to the cache dtype as set_kv_buffer's `.to` does
        kc_ptr = KCache + slot * stride_kc_slot + offs_h[:, None] * stride_kc_h + offs_d[None, :]
        rot_mask = h_mask & d_mask[None, :]
        tl.store(kc_ptr, cache_value(k1, k_scale_inv, QUANT, FP8_MAX, KCache), mask=rot_mask)
        tl.store(kc_ptr + HALF, cache_value(k2, k_scale_inv, QUANT, FP8_MAX, KCache),
                 mask=rot_mask)
        if TAIL > 0:  # partial rotary: the unrotated dims of k, as they are
            offs_t = tl.arange(0, BLOCK_TAIL)
            tail_mask = h_mask & (offs_t[None, :] < TAIL)
            k_tail = tl.load(K + token * stride_kt + offs_h[:, None] * stride_kh + 2 * HALF
                             + offs_t[None, :], mask=tail_mask, other=0.0)
            tl.store(KCache + slot * stride_kc_slot + offs_h[:, None] * stride_kc_h + 2 * HALF
                     + offs_t[None, :], cache_value(k_tail, k_scale_inv, QUANT, FP8_MAX, KCache),
                     mask=tail_mask)
        offs_v = tl.arange(0, BLOCK_D)
        v_mask = h_mask & (offs_v[None, :] < HEAD_DIM)
        v = tl.load(V + token * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :],
                    mask=v_mask, other=0.0)
        tl.store(VCache + slot * stride_vc_slot + offs_h[:, None] * stride_vc_h
                 + offs_v[None, :], cache_value(v, v_scale_inv, QUANT, FP8_MAX, VCache),
                 mask=v_mask)


def _check_qk(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[T, H, head_dim] views of q and k, and rot_dim; asserts the layout the kernel needs."""
    num_tokens = positions.shape[0]
    q3 = q.view(num_tokens, math.prod(q.shape[1:]) // head_dim, head_dim)  # also for T == 0
    k3 = k.view(num_tokens, math.prod(k.shape[1:]) // head_dim, head_dim)
    assert q3.dtype == k3.dtype, "q and k must share a dtype"
    assert q3.stride(2) == 1 and k3.stride(2) == 1, "head_dim must be contiguous"
    assert cos_cache.stride(1) == 1 and sin_cache.stride(1) == 1
    rot_dim = cos_cache.shape[1]
    assert rot_dim % 2 == 0 and rot_dim <= head_dim
    return q3, k3, rot_dim


def apply_rotary_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                         head_dim: int) -> None:
    """Rotate q and k in place. positions: [T] (any int dtype)."""
    q3, k3, rot_dim = _check_qk(positions, q, k, cos_cache, sin_cache, head_dim)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    half = rot_dim // 2
    # STORE_KV off: the cache arguments are placeholders the kernel never touches
    _rotary_kernel[(num_tokens,)](
        positions, q3, k3, cos_cache, sin_cache, q3.stride(0), q3.stride(1), k3.stride(0),
        k3.stride(1), cos_cache.stride(0), sin_cache.stride(0), q3.shape[1], k3.shape[1],
        k3, k3, k3, positions, 0, 0, 0, 0, 0, 0,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(q3.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k3.shape[1]),
        STORE_KV=False, HEAD_DIM=head_dim, BLOCK_D=1, TAIL=0, BLOCK_TAIL=1, num_warps=4,
        **pdl_launch_args(q3))


def apply_rotary_and_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                              head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              loc: torch.Tensor, k_scale: float = 1.0,
                              v_scale: float = 1.0,
                              qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
                              ) -> None:
    """Rotate q and k in place and store this pass's K/V into the pool, in one launch.
    qk_norm = (q weight, k weight, eps) [head_dim] each: q and k are RMS-normed per head
    first, in the same launch (rope over whole heads only), as RMSNorm over [T * H, head_dim]
    rows followed by this kernel would give them up to float32 order in the variance.

    v: [T, Hk * head_dim] (rows may be strided, like q and k). k_cache / v_cache: one layer's
    [slots, Hk, head_dim] pool buffers (head_dim contiguous). loc: [T] int32 or int64 KV slot of
    each token. Afterwards k_cache[loc] == rotated k and v_cache[loc] == v, cast to the caches'
    dtype, exactly as `apply_rotary_inplace` followed by `TokenToKVPool.set_kv_buffer`. FP8
    caches get value / scale saturated to the FP8 range (KVPool.quantize)."""
    q3, k3, rot_dim = _check_qk(positions, q, k, cos_cache, sin_cache, head_dim)
    num_tokens, num_kv_heads = positions.shape[0], k3.shape[1]
    v3 = v.view(num_tokens, math.prod(v.shape[1:]) // head_dim, head_dim)
    assert v3.shape == k3.shape, "v must have k's heads"
    assert v3.stride(2) == 1, "head_dim of v must be contiguous"
    assert loc.shape == (num_tokens,) and loc.dtype in (torch.int32, torch.int64)
    store_args = kv_store_args(k_cache, v_cache, num_kv_heads, head_dim, k_scale, v_scale)
    assert k_cache.device == v_cache.device == k3.device
    if num_tokens == 0:
        return
    half, tail = rot_dim // 2, head_dim - rot_dim
    norm_args: dict = {}
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        assert tail == 0, "per-head norms fuse with a rope over whole heads"
        assert q_weight.shape == k_weight.shape == (head_dim,)
        assert q_weight.dtype == k_weight.dtype == q3.dtype, "norm weights in q's dtype"
        norm_args = dict(QK_NORM=True, QNormW=q_weight, KNormW=k_weight, norm_eps=eps)
    _rotary_kernel[(num_tokens,)](
        positions, q3, k3, cos_cache, sin_cache, q3.stride(0), q3.stride(1), k3.stride(0),
        k3.stride(1), cos_cache.stride(0), sin_cache.stride(0), q3.shape[1], num_kv_heads,
        v3, k_cache, v_cache, loc, v3.stride(0), v3.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(q3.shape[1]),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        STORE_KV=True, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        TAIL=tail, BLOCK_TAIL=triton.next_power_of_2(max(tail, 1)), num_warps=4,
        **store_args, **norm_args, **pdl_launch_args(q3))


def kv_store_args(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int,
                  head_dim: int, k_scale: float, v_scale: float) -> dict:
    """The arguments a kernel storing K/V through `cache_value` takes (k_scale_inv,
    v_scale_inv, QUANT, FP8_MAX), after checking that the caches are one layer's [slots, Hk,
    head_dim] pool buffers with head_dim contiguous."""
    for cache in (k_cache, v_cache):
        assert cache.shape[1:] == (num_kv_heads, head_dim), "cache must be [slots, Hk, head_dim]"
        assert cache.stride(2) == 1, "head_dim of the cache must be contiguous"
    quant = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return dict(k_scale_inv=1.0 / k_scale, v_scale_inv=1.0 / v_scale, QUANT=quant,
                FP8_MAX=float(torch.finfo(k_cache.dtype).max) if quant else 448.0)


def rotary_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's apply_rotary_pos_emb on [T, H*head_dim] tensors; returns rotated copies."""
    rot_dim = cos_cache.shape[1]
    cos = cos_cache[positions].to(q.dtype).unsqueeze(1)
    sin = sin_cache[positions].to(q.dtype).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x3 = x.reshape(positions.shape[0], -1, head_dim)
        rot, rest = x3[..., :rot_dim], x3[..., rot_dim:]
        half = rot_dim // 2
        rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated_half * sin, rest), dim=-1).reshape(x.shape)

    return rotate(q), rotate(k)
