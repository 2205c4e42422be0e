"""Rotary position embedding (HF Llama layout: rotate_half over the two halves of a head).

The cos/sin cache is built in fp32 as HF does (frequencies of every supported scaling kind from
transformers' own functions, yarn's attention factor folded in) and cast to the activations'
dtype at use, so greedy outputs match transformers.

Models do not rotate q/k themselves: they hand a `RopeInput` to `RadixAttention`, and the
attention backend applies it (the Triton backend through the KV pool's fused rope + store).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.layers.norm import RMSNorm


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """Unscaled rope frequencies, base ** (-2i / rotary_dim), fp32."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (float(base) ** exponents)


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot_dim / 2] fp32, attention factor) for the config's rope kind.

    Scaled kinds (linear, dynamic, llama3, yarn) use transformers' own frequency functions, so
    they match the reference implementation; ModelConfig already refused any other kind.
    "dynamic" rescales only past max_position_embeddings, which the context does not exceed
    (unless RADIXSERVE_ALLOW_LONGER_CONTEXT lets it: past them these tables keep the unscaled
    frequencies, where transformers rescales per sequence length), so its frequencies are
    the default ones. yarn's attention factor multiplies cos and sin."""
    kind = config.rope_type
    if kind != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config.hf, "cpu")
        return inv_freq.float(), float(attention_factor)
    base = config.rope_parameters.get("rope_theta", getattr(config.hf, "rope_theta", 10000.0))
    factor = getattr(config.hf, "partial_rotary_factor", None) or \
        config.rope_parameters.get("partial_rotary_factor", 1.0)
    return default_inv_freq(int(config.head_dim * factor), base), 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor,
                 attention_factor: float = 1.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.numel()
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device).float())
        emb = torch.cat((freqs, freqs), dim=-1)
        # [max_position, rotary_dim]: cos of both halves then sin of both halves
        self.register_buffer("cos_cache", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attention_factor, persistent=False)

    @classmethod
    def from_config(cls, config: ModelConfig) -> "RotaryEmbedding":
        inv_freq, attention_factor = rope_frequencies(config)
        return cls(config.head_dim, config.rope_positions, inv_freq, attention_factor)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq*D], k: [T, Hk*D] -> rotated copies of the same shapes."""
        if q.is_cuda:
            try:
                from radixserve.mem.kernels.rope_kv_store import apply_rotary_inplace
                apply_rotary_inplace(positions, q, k, self.cos_cache, self.sin_cache,
                                     self.head_dim)
                return q, k
            except ImportError:
                pass
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return (self._rotate(q, cos, sin), self._rotate(k, cos, sin))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_dim)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        if rest.shape[-1]:  # partial rotary: the dims past rotary_dim pass through
            out = torch.cat((out, rest), dim=-1)
        return out.reshape(shape)


class QKNorm(NamedTuple):
    """The RMSNorms over each head of q and of k that come before rope (Qwen3). A backend's
    fused rope + store kernel takes their weights (mem/kv_pool.PerHeadNorms); otherwise
    `apply` runs them as the model did before rope."""
    q_norm: RMSNorm
    k_norm: RMSNorm
    head_dim: int

    @property
    def q_weight(self) -> torch.Tensor:
        return self.q_norm.weight

    @property
    def k_weight(self) -> torch.Tensor:
        return self.k_norm.weight

    @property
    def eps(self) -> float | None:
        """The norms' eps, None where they differ (a fused kernel takes one)."""
        eps = self.q_norm.variance_epsilon
        return eps if eps == self.k_norm.variance_epsilon else None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed copies of q [T, Hq * head_dim] and k [T, Hk * head_dim]."""
        return (self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape[0], -1),
                self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape[0], -1))


class RopeInput(NamedTuple):
    """Rope for the attention backend to apply to q and k before it stores K and attends
    (after the per-head norms `qk_norm`, where the model has them)."""
    positions: torch.Tensor  # [T] position of each token
    rotary: RotaryEmbedding
    qk_norm: QKNorm | None = None

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as rope takes them, for backends that do not fuse `qk_norm`."""
        return (q, k) if self.qk_norm is None else self.qk_norm.apply(q, k)

    def unnormed(self) -> "RopeInput":
        """This rope without the norms (once a backend has applied them)."""
        return self._replace(qk_norm=None)
