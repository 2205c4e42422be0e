"""MLA's rope and latent entry in one Triton launch (DeepSeek-V2, interleaved rope).

Per token: rotate the rope part of every query head in place (pairs (x[2i], x[2i+1]), in
float32, rounded to the activations' dtype, as the PyTorch path does) and write the pool entry
[latent | rotated k_pe]. Replaces ~18 small torch kernels per layer (casts, unflatten, stack,
the products, the concatenation). cos/sin tables are the RotaryEmbedding's: each frequency in
the first half of a row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_pairs(base, offs_pair, cos, sin, mask):
    even = tl.load(base + 2 * offs_pair, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(base + 2 * offs_pair + 1, mask=mask, other=0.0).to(tl.float32)
    return even * cos - odd * sin, even * sin + odd * cos


@triton.jit
def _mla_rope_kernel(Q, Latent, K_pe, Positions, Cos, Sin, Entries,
                     num_heads, stride_qt, stride_qh, stride_lt, stride_kt, stride_ct, stride_et,
                     NOPE_DIM: tl.constexpr, LATENT_DIM: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, BLOCK_LATENT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_pair = tl.arange(0, BLOCK_HALF)
    pair_mask = offs_pair < HALF
    cos = tl.load(Cos + pos * stride_ct + offs_pair, mask=pair_mask, other=1.0)
    sin = tl.load(Sin + pos * stride_ct + offs_pair, mask=pair_mask, other=0.0)
    for head in range(0, num_heads):
        base = Q + token * stride_qt + head * stride_qh + NOPE_DIM
        out_even, out_odd = _rotate_pairs(base, offs_pair, cos, sin, pair_mask)
        tl.store(base + 2 * offs_pair, out_even.to(Q.dtype.element_ty), mask=pair_mask)
        tl.store(base + 2 * offs_pair + 1, out_odd.to(Q.dtype.element_ty), mask=pair_mask)
    k_even, k_odd = _rotate_pairs(K_pe + token * stride_kt, offs_pair, cos, sin, pair_mask)
    entry = Entries + token * stride_et
    tl.store(entry + LATENT_DIM + 2 * offs_pair, k_even.to(Entries.dtype.element_ty),
             mask=pair_mask)
    tl.store(entry + LATENT_DIM + 2 * offs_pair + 1, k_odd.to(Entries.dtype.element_ty),
             mask=pair_mask)
    for start in range(0, LATENT_DIM, BLOCK_LATENT):
        offs = start + tl.arange(0, BLOCK_LATENT)
        mask = offs < LATENT_DIM
        tl.store(entry + offs, tl.load(Latent + token * stride_lt + offs, mask=mask), mask=mask)


def mla_rope_and_entries(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                         positions: torch.Tensor, cos_cache: torch.Tensor,
                         sin_cache: torch.Tensor, nope_dim: int) -> torch.Tensor:
    """q: [T, H, nope + rope] (its rope part rotated in place); latent [T, L] (normed);
    k_pe [T, rope] (may be a strided view). Returns entries [T, L + rope] = [latent | rot k_pe]."""
    num_tokens, num_heads, _ = q.shape
    latent_dim, rope_dim = latent.shape[1], k_pe.shape[1]
    assert q.stride(2) == 1 and latent.stride(1) == 1 and k_pe.stride(1) == 1
    entries = torch.empty(num_tokens, latent_dim + rope_dim, dtype=latent.dtype,
                          device=latent.device)
    if num_tokens:
        half = rope_dim // 2
        _mla_rope_kernel[(num_tokens,)](
            q, latent, k_pe, positions, cos_cache, sin_cache, entries, num_heads,
            q.stride(0), q.stride(1), latent.stride(0), k_pe.stride(0), cos_cache.stride(0),
            entries.stride(0), NOPE_DIM=nope_dim, LATENT_DIM=latent_dim, HALF=half,
            BLOCK_HALF=triton.next_power_of_2(half), BLOCK_LATENT=512, num_warps=4)
    return entries
