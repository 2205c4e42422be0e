"""Granite-4.0-H (GraniteMoeHybridForCausalLM: H-Micro, H-Tiny, H-Small) and Bamba: Mamba-2 and
attention layers, each followed by an MLP.

`layer_types` names each layer's mixer: "linear_attention", a Mamba-2 mixer (layers/
mamba2_mixer.py, named `mamba` in the checkpoints), or "attention" with rope only where
`position_embedding_type` is "rope" (the releases use none), scaled by `attention_multiplier`
rather than head_dim ** -0.5. After it, a shared SwiGLU MLP (`shared_mlp`, gate|up stored merged
as `input_linear`) plus, where the model has experts, routed ones (`block_sparse_moe`: the
router `router.layer`, every expert's gate|up in one `input_linear` [E, 2I, H] and down in one
`output_linear` [E, H, I], top-k softmax). Granite's multipliers: the embeddings scaled by
`embedding_multiplier`, each mixer's and MLP's output by `residual_multiplier` before its
residual add, and the logits divided by `logits_scaling`. Llama's RMSNorm throughout.
"""
from __future__ import annotations

import torch
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.layers.merged_linear import ALL_PIECES
from radixserve.layers.mamba2_mixer import Mamba2Mixer
from radixserve.layers.moe.experts import expert_weight_target
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import (CausalLM, DecoderAttention, DecoderModel,
                                      KVForAttentionLayers, PreNormMixerLayer, dense_mlp,
                                      hybrid_layer_types, index_among_type, renamed_target)
from radixserve.models.moe_blocks import SparseMoeBlock

# Granite's checkpoint names -> ours (the experts' then as FusedMoE's stacked tensors)
_RENAMES = ((".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
            (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
            (".block_sparse_moe.router.layer.", ".mlp.gate."),
            (".shared_mlp.output_linear.", ".shared_mlp.down_proj."),
            (".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj."))
# Bamba's (and Falcon-H1's) MLP and its norm
BAMBA_RENAMES = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."))


def granite_weight_target(name: str, shared_in_block: bool) -> tuple[str, object] | None:
    """Granite's checkpoint names of experts and the shared MLP (`_RENAMES`) -> ours: the
    shared MLP inside the MoE block (`shared_in_block`, where the model has experts) or the
    layer's whole MLP; its gate|up stored merged loads as both pieces (merged_linear.ALL_PIECES);
    None for names Granite shares with Llama."""
    for old, new in _RENAMES:
        if old in name:
            name = name.replace(old, new)
            name = name.replace(".shared_mlp.", ".mlp.shared_mlp." if shared_in_block
                                else ".mlp.")
            if name.endswith(".gate_up_proj.weight"):
                return name, ALL_PIECES
            return expert_weight_target(name) or (name, None)
    return None


class GraniteHybridLayer(PreNormMixerLayer):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding | None
                 ) -> None:
        super().__init__()
        hf = config.hf
        types = hybrid_layer_types(config)
        index = index_among_type(types, layer_id)
        self.multiplier = float(getattr(hf, "residual_multiplier", 1.0))
        if types[layer_id] == "linear_attention":
            self.mamba = Mamba2Mixer(
                config.hidden_size, hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state,
                hf.mamba_n_groups, hf.mamba_d_conv, config.rms_norm_eps, index,
                use_conv_bias=hf.mamba_conv_bias, proj_bias=hf.mamba_proj_bias,
                time_step_limit=tuple(hf.time_step_limit or (0.0, float("inf"))))
        else:
            scaling = getattr(hf, "attention_multiplier", None)
            self.self_attn = DecoderAttention(config, index, rotary, scaling=scaling and
                                              float(scaling))
        shared = getattr(hf, "shared_intermediate_size", None)
        if getattr(hf, "num_local_experts", 0):  # the shared MLP in the block, reduced once
            self.mlp: nn.Module = SparseMoeBlock(config, config.intermediate_size, shared,
                                                 shared_name="shared_mlp")
        elif shared is not None:
            self.mlp = dense_mlp(config, shared)
        else:  # Bamba: gate and up stored apart
            self.mlp = dense_mlp(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def mix(self, positions: torch.Tensor, normed: torch.Tensor,
            forward_batch: ForwardBatch) -> torch.Tensor:
        if hasattr(self, "mamba"):
            return self.mamba(normed, forward_batch)
        return self.self_attn(positions, normed, forward_batch)


class GraniteMoeHybridForCausalLM(KVForAttentionLayers, CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        hf = config.hf
        rotary = RotaryEmbedding.from_config(config) if self.uses_rope(config) else None

        def make_layer(config: ModelConfig, layer_id: int, _: RotaryEmbedding) -> nn.Module:
            return GraniteHybridLayer(config, layer_id, rotary)

        scale = float(getattr(hf, "embedding_multiplier", 1.0))
        super().__init__(config, DecoderModel(config, make_layer, RMSNorm,
                                              embed_scale=None if scale == 1.0 else scale))
        self.logits_scaling = float(getattr(hf, "logits_scaling", 1.0))

    @staticmethod
    def uses_rope(config: ModelConfig) -> bool:
        return getattr(config.hf, "position_embedding_type", None) == "rope"

    def weight_target(self, name: str) -> tuple[str, object] | None:
        return granite_weight_target(name, bool(self.config.hf.num_local_experts))

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        # logits / logits_scaling, through the LM head
        return hidden if self.logits_scaling == 1.0 else hidden / self.logits_scaling


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    """Bamba: Granite-4.0-H-Micro's layers (no experts, no multipliers) under other names (the
    MLP `feed_forward` with gate and up apart, its norm `pre_ff_layernorm`, the final norm
    `final_layernorm`), attention with rope over half of each head (partial_rotary_factor)."""

    checkpoint_prefixes = {"model.final_layernorm.": "model.norm."}

    @staticmethod
    def uses_rope(config: ModelConfig) -> bool:
        return True

    def weight_target(self, name: str) -> tuple[str, object] | None:
        return renamed_target(name, BAMBA_RENAMES, self.packed_modules_mapping)


EntryClass = [GraniteMoeHybridForCausalLM, BambaForCausalLM]
