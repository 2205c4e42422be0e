"""Rotary position embedding (HF Llama layout: rotate_half over the two halves of a head).

The cos/sin cache is built in fp32 as HF does (including llama3 frequency scaling) and cast to the
activations' dtype at use, so greedy outputs match transformers.

Models do not rotate q/k themselves: they hand a `RopeInput` to `RadixAttention`, and the
attention backend applies it (the Triton backend fuses it with its KV-cache store).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from radixserve.config import RopeScaling


def rope_inv_freq(rotary_dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float()
                               / rotary_dim))
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind != "llama3":
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, base, scaling or RopeScaling())
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # [max_position, head_dim]: cos of both halves then sin of both halves
        self.register_buffer("cos_cache", torch.cat((freqs, freqs), dim=-1).cos(),
                             persistent=False)
        self.register_buffer("sin_cache", torch.cat((freqs, freqs), dim=-1).sin(),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq*D], k: [T, Hk*D] -> rotated copies of the same shapes."""
        if q.is_cuda:
            try:
                from radixserve.layers.kernels.rotary import apply_rotary_inplace
                apply_rotary_inplace(positions, q, k, self.cos_cache, self.sin_cache,
                                     self.head_dim)
                return q, k
            except ImportError:
                pass
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return (self._rotate(q, cos, sin), self._rotate(k, cos, sin))

    def forward_and_store_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k in place and write rotated k / v into k_cache[loc] / v_cache[loc]
        ([slots, Hk, D] pool buffers of one layer), one Triton kernel. Needs triton; returns
        the rotated q, k (the inputs themselves)."""
        from radixserve.layers.kernels.rotary import apply_rotary_and_store_kv
        apply_rotary_and_store_kv(positions, q, k, v, self.cos_cache, self.sin_cache,
                                  self.head_dim, k_cache, v_cache, loc)
        return q, k

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos + rotated * sin).reshape(shape)


class RopeInput(NamedTuple):
    """Rope for the attention backend to apply to q and k before it stores K and attends."""
    positions: torch.Tensor  # [T] position of each token
    rotary: RotaryEmbedding
