"""Cohere's Command models: Command-R / R+ (CohereForCausalLM) and Command-R7B / Command-A
(Cohere2ForCausalLM).

  layer   parallel: out = x + attn(norm(x)) + mlp(norm(x)), one norm per layer, a LayerNorm
          without bias computed in float32 (`CohereLayerNorm`)
  rope    over adjacent pairs, brought to halves by permuting q and k at load
          (layers/rope_pairs.py); Command-R+'s per-head q / k LayerNorms (`use_qk_norm`,
          a weight per head) run before it, their weights permuted alike
  Cohere2 windows of `sliding_window` on three layers of four (`layer_types`), rope only
          there: the full-attention layers have no positional encoding
  logits  scaled by `logit_scale` (the final hidden states, since the head is linear); the
          head tied to the embedding
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.layers.rope_pairs import RopePairsQKV, pair_order
from radixserve.layers.rotary import RopeInput, RotaryEmbedding
from radixserve.models.blocks import CausalLM, DecoderAttention, DecoderModel, dense_mlp


class CohereLayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight over the last dim, in float32, no bias; `shape`
    (heads, head_dim) gives each head its own weight (Command-R+'s q / k norms)."""

    def __init__(self, shape: int | tuple[int, ...], eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), x.shape[-1:], eps=self.variance_epsilon)
        return (self.weight.float() * normed).to(x.dtype)


class HeadNorm(CohereLayerNorm):
    """A per-head q or k norm of this rank's heads: the checkpoint's [heads, head_dim] weight
    cut to them and its columns permuted as the rope's pairs were (`pair_order`)."""

    def __init__(self, heads: int, head_dim: int, eps: float, first_head: int) -> None:
        super().__init__((heads, head_dim), eps)
        self.first_head = first_head
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        heads, head_dim = param.shape
        if loaded.dim() != 2 or loaded.shape[1] != head_dim or \
                loaded.shape[0] < self.first_head + heads:
            raise ValueError(f"a per-head norm of shape {tuple(loaded.shape)}, expected "
                             f"[>= {self.first_head + heads}, {head_dim}]")
        rows = loaded.narrow(0, self.first_head, heads)
        param.data.copy_(rows[:, pair_order(head_dim).to(rows.device)])


class CohereAttention(DecoderAttention):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        types = config.layer_types
        uses_rope = types is None or types[layer_id] == "sliding_attention"
        super().__init__(config, layer_id, rotary if uses_rope else None,
                         qkv_linear=RopePairsQKV)
        if getattr(config.hf, "use_qk_norm", False):
            eps, qkv = config.hf.layer_norm_eps, self.qkv_proj
            self.q_norm = HeadNorm(qkv.num_heads, self.head_dim, eps,  # type: ignore[assignment]
                                   qkv.first_head("q"))
            self.k_norm = HeadNorm(qkv.num_kv_heads, self.head_dim, eps,  # type: ignore[assignment]
                                   qkv.first_head("k"))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               forward_batch: ForwardBatch, kv_stored: bool = False) -> torch.Tensor:
        """With the per-head LayerNorms: normed here, then rope and attention (the base's
        q / k norms are Qwen's RMSNorms, which the backends fuse; `rope_store` already
        declines to carry rope past these)."""
        if self.q_norm is None or self.k_norm is None:
            return super().attend(positions, qkv, forward_batch, kv_stored)
        q, k, v = self.qkv_proj.split(qkv)
        tokens = q.shape[0]
        q = self.q_norm(q.reshape(tokens, -1, self.head_dim)).reshape(tokens, -1)
        k = self.k_norm(k.reshape(tokens, -1, self.head_dim)).reshape(tokens, -1)
        rope = RopeInput(positions, self.rotary) if self.rotary is not None else None
        return self.attn(q, k, v, forward_batch, rope)


class CohereLayer(nn.Module):
    """One norm, attention and MLP side by side; returns the whole stream (residual None)."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = CohereAttention(config, layer_id, rotary)
        self.mlp = dense_mlp(config)
        self.input_layernorm = CohereLayerNorm(config.hidden_size, config.hf.layer_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, forward_batch: ForwardBatch
                ) -> tuple[torch.Tensor, None]:
        stream = hidden if residual is None else hidden + residual
        normed = self.input_layernorm(stream)
        return stream + self.self_attn(positions, normed, forward_batch) + self.mlp(normed), None


class CohereForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        eps = config.hf.layer_norm_eps

        def final_norm(size: int, _rms_eps: float) -> CohereLayerNorm:
            return CohereLayerNorm(size, eps)

        super().__init__(config, DecoderModel(config, CohereLayer, norm_cls=final_norm))
        self.logit_scale = float(getattr(config.hf, "logit_scale", None) or 1.0)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.logit_scale == 1.0 else hidden * self.logit_scale


class Cohere2ForCausalLM(CohereForCausalLM):
    """Command-R7B / Command-A: windows and rope on `sliding_attention` layers, none on the
    others (CohereAttention reads `layer_types`)."""


EntryClass = [CohereForCausalLM, Cohere2ForCausalLM]
