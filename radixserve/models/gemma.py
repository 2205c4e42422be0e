"""Gemma (1) and CodeGemma: the Llama block with Gemma's (1 + weight) RMSNorms, a GeGLU MLP
(tanh GELU: the releases' "gelu" means it, as transformers reads it), embeddings scaled by
sqrt(hidden_size) and tied; no soft-capping, windows or extra norms (Gemma-2's, gemma2.py)."""
from __future__ import annotations

import torch
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.layers.norm import GemmaRMSNorm
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import CausalLM, DecoderAttention, DecoderModel, GatedMLP


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_id, rotary)
        activation = getattr(config.hf, "hidden_act", None) or "gelu_pytorch_tanh"
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            "gelu_pytorch_tanh" if activation == "gelu" else activation)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, forward_batch: ForwardBatch
                ) -> tuple[torch.Tensor, None]:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), forward_batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), None


class GemmaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, GemmaDecoderLayer, GemmaRMSNorm,
                                              embed_scale=config.hidden_size ** 0.5))


EntryClass = [GemmaForCausalLM]
