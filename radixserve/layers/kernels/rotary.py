"""Rotary position embedding (neox / HF Llama rotate_half layout), applied in place, in Triton.

Layout: q is [T, Hq * head_dim] (or [T, Hq, head_dim]), k likewise with Hk heads; the last dim
of each head must be contiguous, rows may be strided (q and k may be views into one qkv tensor).
cos_cache / sin_cache are [max_position, rot_dim] with both halves equal (cat(freqs, freqs)), as
HF builds them; rot_dim <= head_dim and dims past rot_dim are left alone (partial rotary).
Within the rotated dims, with x1 / x2 the first / second half:
  out1 = x1 * cos - x2 * sin,   out2 = x2 * cos + x1 * sin.
Rounding follows HF's `q * cos + rotate_half(q) * sin` in the activation dtype: cos/sin are
rounded to it, each product is rounded, then the sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, row_offset, stride_h, cos, sin, num_heads,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    ptr1 = X + row_offset + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    x1_cos = (x1 * cos[None, :]).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin[None, :]).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos[None, :]).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin[None, :]).to(dtype).to(tl.float32)
    tl.store(ptr1, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(ptr1 + HALF, (x2_cos + x1_sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(Positions, Q, K, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_cos, stride_sin, num_q_heads, num_k_heads,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
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
                  HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(K, token * stride_kt, stride_kh, cos, sin, num_k_heads,
                  HALF, BLOCK_HK, BLOCK_HALF)


def apply_rotary_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                         head_dim: int) -> None:
    """Rotate q and k in place. positions: [T] (any int dtype)."""
    num_tokens = positions.shape[0]
    q3 = q.view(num_tokens, -1, head_dim)
    k3 = k.view(num_tokens, -1, head_dim)
    assert q3.dtype == k3.dtype, "q and k must share a dtype"
    assert q3.stride(2) == 1 and k3.stride(2) == 1, "head_dim must be contiguous"
    assert cos_cache.stride(1) == 1 and sin_cache.stride(1) == 1
    rot_dim = cos_cache.shape[1]
    assert rot_dim % 2 == 0 and rot_dim <= head_dim
    if num_tokens == 0:
        return
    half = rot_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q3, k3, cos_cache, sin_cache, q3.stride(0), q3.stride(1), k3.stride(0),
        k3.stride(1), cos_cache.stride(0), sin_cache.stride(0), q3.shape[1], k3.shape[1],
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(q3.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k3.shape[1]), num_warps=4)


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
