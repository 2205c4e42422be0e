"""Qwen2-MoE and Qwen3-MoE: the Qwen attention (q/k/v bias for Qwen2, per-head q/k norms for
Qwen3) with a sparse MoE block on the layers `decoder_sparse_step` selects (dense on
`mlp_only_layers`); Qwen2-MoE adds a shared expert scaled by a sigmoid gate."""
from __future__ import annotations

import functools

from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.layers.moe.experts import expert_weight_target
from radixserve.models.blocks import CausalLM, DecoderLayer, DecoderModel, dense_mlp
from radixserve.models.moe_blocks import SparseMoeBlock


def _is_sparse(config: ModelConfig, layer_id: int) -> bool:
    hf = config.hf
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return layer_id not in (getattr(hf, "mlp_only_layers", None) or []) and \
        hf.num_experts > 0 and (layer_id + 1) % step == 0


def qwen_mlp(config: ModelConfig, layer_id: int) -> nn.Module:
    if not _is_sparse(config, layer_id):
        return dense_mlp(config)
    shared = getattr(config.hf, "shared_expert_intermediate_size", 0) or 0
    return SparseMoeBlock(config, config.hf.moe_intermediate_size, shared,
                          shared_name="shared_expert", shared_gate=bool(shared))


class Qwen2MoeForCausalLM(CausalLM):
    weight_target = staticmethod(expert_weight_target)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, functools.partial(
            DecoderLayer, make_mlp=qwen_mlp)))


class Qwen3MoeForCausalLM(CausalLM):
    weight_target = staticmethod(expert_weight_target)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, functools.partial(
            DecoderLayer, qk_norm=True, make_mlp=qwen_mlp)))


EntryClass = [Qwen2MoeForCausalLM, Qwen3MoeForCausalLM]
