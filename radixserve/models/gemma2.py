"""Gemma-2: GeGLU MLP, embeddings scaled by sqrt(hidden_size), RMSNorm of (1 + weight) before
and after both attention and MLP, attention logit soft-capping, final logit soft-capping, a
sliding window on alternating layers (`layer_types`), queries scaled by
query_pre_attn_scalar ** -0.5, tied embeddings."""
from __future__ import annotations

import torch
from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.core.forward_batch import ForwardBatch
from radixserve.layers.norm import GemmaRMSNorm
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import CausalLM, DecoderAttention, DecoderModel, GatedMLP


class Gemma2DecoderLayer(nn.Module):
    attention_cls: type[DecoderAttention] = DecoderAttention  # Gemma-3 adds q/k norms

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = config.hf
        self.self_attn = self.attention_cls(
            config, layer_id, rotary, scaling=hf.query_pre_attn_scalar ** -0.5,
            logit_cap=float(hf.attn_logit_softcapping or 0.0))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            hf.hidden_activation or "gelu_pytorch_tanh")
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, forward_batch: ForwardBatch
                ) -> tuple[torch.Tensor, None]:
        attn = self.self_attn(positions, self.input_layernorm(hidden), forward_batch)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp), None


class Gemma2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, Gemma2DecoderLayer, GemmaRMSNorm,
                                              embed_scale=config.hidden_size ** 0.5))


EntryClass = [Gemma2ForCausalLM]
