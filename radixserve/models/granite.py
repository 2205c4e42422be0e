"""IBM Granite 3.x: GraniteForCausalLM (dense: granite-3.x-2b / 8b) and GraniteMoeForCausalLM /
GraniteMoeSharedForCausalLM (granite-3.x-1b-a400m / 3b-a800m: top-k experts in every layer,
a shared MLP beside them where `shared_intermediate_size` says).

Llama's layer with Granite's multipliers: the embeddings scaled by `embedding_multiplier`,
attention scaled by `attention_multiplier` (instead of head_dim ** -0.5), each attention and
MLP output scaled by `residual_multiplier` before its residual add, the logits divided by
`logits_scaling`. The experts' checkpoint names are Granite-4.0-H's (granite_hybrid.py:
`block_sparse_moe.router.layer`, `input_linear` [E, 2I, H], `output_linear` [E, H, I]; the
shared MLP's gate|up stored merged as `shared_mlp.input_linear`)."""
from __future__ import annotations

import functools

import torch
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import (CausalLM, DecoderAttention, DecoderModel, MLPFactory,
                                      PreNormMixerLayer, dense_mlp)
from radixserve.models.granite_hybrid import granite_weight_target
from radixserve.models.moe_blocks import SparseMoeBlock


def _attention(config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
    return DecoderAttention(config, layer_id, rotary,
                            scaling=float(config.hf.attention_multiplier))


def _experts(config: ModelConfig, _layer_id: int) -> nn.Module:
    return SparseMoeBlock(config, config.intermediate_size,
                          getattr(config.hf, "shared_intermediate_size", 0) or 0,
                          shared_name="shared_mlp")


class GraniteLayer(PreNormMixerLayer):
    """Llama's pre-norm layer whose attention and MLP outputs are scaled by the residual
    multiplier before their adds (PreNormMixerLayer's `multiplier`, as Granite-4.0-H's)."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 make_mlp: "MLPFactory | None" = None) -> None:
        super().__init__()
        self.multiplier = float(config.hf.residual_multiplier)
        self.self_attn = _attention(config, layer_id, rotary)
        self.mlp = make_mlp(config, layer_id) if make_mlp else dense_mlp(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def mix(self, positions: torch.Tensor, normed: torch.Tensor,
            forward_batch: ForwardBatch) -> torch.Tensor:
        return self.self_attn(positions, normed, forward_batch)


class GraniteForCausalLM(CausalLM):
    make_mlp = None  # the dense SwiGLU

    def __init__(self, config: ModelConfig) -> None:
        scale = float(getattr(config.hf, "embedding_multiplier", 1.0))
        layer = functools.partial(GraniteLayer, make_mlp=self.make_mlp)
        super().__init__(config, DecoderModel(config, layer,
                                              embed_scale=None if scale == 1.0 else scale))
        self.logits_scaling = float(getattr(config.hf, "logits_scaling", 1.0))

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        # logits / logits_scaling, through the LM head
        return hidden if self.logits_scaling == 1.0 else hidden / self.logits_scaling


class GraniteMoeForCausalLM(GraniteForCausalLM):
    make_mlp = staticmethod(_experts)

    def weight_target(self, name: str) -> tuple[str, object] | None:
        return granite_weight_target(name, shared_in_block=True)


EntryClass = [GraniteForCausalLM, GraniteMoeForCausalLM]
