"""Mixtral: the Llama block with a sparse MoE (softmax top-2 of 8, renormalised) in place of the
MLP. The checkpoint's `block_sparse_moe` (gate, experts.{e}.w1/w2/w3) loads into `mlp`."""
from __future__ import annotations

import functools

from radixserve.core.model_config import ModelConfig
from radixserve.layers.moe.experts import expert_weight_target
from radixserve.models.blocks import CausalLM, DecoderLayer, DecoderModel
from radixserve.models.moe_blocks import SparseMoeBlock


def mixtral_moe(config: ModelConfig, layer_id: int) -> SparseMoeBlock:
    return SparseMoeBlock(config, config.intermediate_size)


class MixtralForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, functools.partial(DecoderLayer,
                                                                         make_mlp=mixtral_moe)))

    @staticmethod
    def weight_target(name: str) -> tuple[str, object] | None:
        if ".block_sparse_moe." not in name:
            return None
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_weight_target(name) or (name, None)


EntryClass = [MixtralForCausalLM]
