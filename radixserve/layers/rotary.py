"""Rotary position embedding (HF Llama layout: rotate_half over the two halves of a head).

The cos/sin cache is built in fp32 as HF does (frequencies of every supported scaling kind from
transformers' own functions, yarn's attention factor folded in) and cast to the activations'
dtype at use, so greedy outputs match transformers.

Models do not rotate q/k themselves: they hand a `RopeInput` to `RadixAttention`, and the
attention backend applies it (the Triton backend through the KV pool's fused rope + store).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch
from torch import nn

from radixserve.core.long_rope import LongRopeSwitch
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
    the default ones. yarn's attention factor multiplies cos and sin. longrope's two tables
    are RotaryEmbedding.from_config's alone."""
    kind = config.rope_type
    if kind == "longrope":
        raise ValueError("rope scaling 'longrope' is only supported on a model's one table")
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
        switch = LongRopeSwitch.from_config(config)
        if switch is not None:
            return cls.long_rope(config, switch)
        inv_freq, attention_factor = rope_frequencies(config)
        return cls(config.head_dim, config.rope_positions, inv_freq, attention_factor)

    @classmethod
    def long_rope(cls, config: ModelConfig, switch: LongRopeSwitch) -> "RotaryEmbedding":
        """LongRoPE's tables (core/long_rope.py): the short factors' rows, then the long
        factors' from row `switch.long_table_row`; transformers' frequencies for both (the
        long ones as it computes them for a sequence past the original context), each table
        scaled by its `short_mscale` / `long_mscale` where the rope parameters give them
        (PhiMoE's), else by transformers' one attention factor."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        frequencies = ROPE_INIT_FUNCTIONS["longrope"]
        short, factor = frequencies(config.hf, "cpu")
        long, _ = frequencies(config.hf, "cpu", seq_len=switch.original_positions + 1)
        params, rows = config.rope_parameters, switch.long_table_row
        table = cls(config.head_dim, rows, short.float(),
                    float(params.get("short_mscale") or factor))
        long_table = cls(config.head_dim, rows, long.float(),
                         float(params.get("long_mscale") or factor))
        table.cos_cache = torch.cat((table.cos_cache, long_table.cos_cache))
        table.sin_cache = torch.cat((table.sin_cache, long_table.sin_cache))
        return table

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


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rope (Qwen2-VL, Qwen2.5-VL; `mrope_section` of the rope parameters): the
    rotary pairs are cut into three sections, rotated by a token's temporal, row and column
    positions; contiguous sections (t | h | w, as transformers' `apply_multimodal_rotary_pos_emb`)
    or, `interleaved`, pair i by i mod 3 within 3 x each section (Qwen3-VL's, Qwen3.5's;
    sections past the rotary pairs are cut short, as there). Text tokens have
    all three equal, which is plain rope at that position: decode and passes without images
    use the tables as they are (their 1-D positions carry the images' shifts,
    `ForwardBatch.position_offsets`). A pass with images runs inside `per_token_tables`."""

    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor,
                 sections: list[int], interleaved: bool = False) -> None:
        super().__init__(head_dim, max_position, inv_freq)
        pairs = inv_freq.numel()
        if len(sections) != 3 or (not interleaved and sum(sections) != pairs):
            raise ValueError(f"mrope_section {sections} must be three sections summing to the "
                             f"{pairs} rotary pairs")
        axis = torch.zeros(pairs, dtype=torch.int64)
        if interleaved:
            index = torch.arange(pairs)
            for row in (1, 2):
                axis[(index % 3 == row) & (index < 3 * sections[row])] = row
        else:
            axis[sections[0]:sections[0] + sections[1]] = 1
            axis[sections[0] + sections[1]:] = 2
        # which position row rotates each of the rotary_dim columns (both halves alike)
        self.register_buffer("column_axis", torch.cat((axis, axis)), persistent=False)

    @contextmanager
    def per_token_tables(self, positions_3d: torch.Tensor) -> Iterator[torch.Tensor]:
        """Within: `cos_cache` / `sin_cache` are the pass's own rows [T, rotary_dim] (column j of
        token i at its position in row `column_axis[j]` of `positions_3d` [3, T]), and the
        positions to hand the layers (the yielded [T] arange) index them. Every backend and
        fused rope kernel reads the tables through this module, so none needs to know."""
        cos_cache, sin_cache = self.cos_cache, self.sin_cache
        columns = torch.arange(self.rotary_dim, device=cos_cache.device)
        rows = positions_3d.to(cos_cache.device)[self.column_axis].t()  # [T, rotary_dim]
        try:
            self.cos_cache = cos_cache[rows, columns].contiguous()
            self.sin_cache = sin_cache[rows, columns].contiguous()
            yield torch.arange(rows.shape[0], device=cos_cache.device)
        finally:
            self.cos_cache, self.sin_cache = cos_cache, sin_cache


# language models whose rope transformers always makes multimodal, interleaved (sections
# [11, 11, 10] where the config names none): Qwen3-VL's and Qwen3.5's
INTERLEAVED_MROPE_TYPES = ("qwen3_vl_text", "qwen3_vl_moe_text", "qwen3_5_text",
                           "qwen3_5_moe_text")


def rotary_from_config(config: ModelConfig) -> RotaryEmbedding:
    """The model's rope table: multimodal where its rope parameters name `mrope_section` (and
    always for Qwen3-VL's and Qwen3.5's language models, as transformers builds them)."""
    interleaved = getattr(config.hf, "model_type", None) in INTERLEAVED_MROPE_TYPES
    sections = config.rope_parameters.get("mrope_section") or \
        ([11, 11, 10] if interleaved else None)
    if not sections:
        return RotaryEmbedding.from_config(config)
    inv_freq, factor = rope_frequencies(config)
    if factor != 1.0:
        raise ValueError("mrope_section with a scaled rope is not supported")
    return MRotaryEmbedding(config.head_dim, config.rope_positions, inv_freq,
                            [int(s) for s in sections],
                            bool(config.rope_parameters.get("mrope_interleaved", interleaved)))


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
