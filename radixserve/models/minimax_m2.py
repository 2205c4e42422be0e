"""MiniMax-M2 / M2.1 / M2.5 (MiniMaxM2ForCausalLM).

Pre-norm layers of GQA attention whose q and k are RMS-normed over the whole projection (all
heads at once, as OLMo-2's, in Llama's rounding; tensor parallelism all-reduces the sums of
squares), rope over the first `rotary_dim` of each head (transformers reads it as
`partial_rotary_factor`), and a sparse MoE in every layer: sigmoid scores plus a correction
bias choose the top 8 of 256 experts, weighted by their sigmoid scores renormalised, no shared
expert. Checkpoint names are Mixtral's (`block_sparse_moe`: gate, experts.{e}.w1/w2/w3) with
the bias beside the gate (`block_sparse_moe.e_score_correction_bias`). The multi-token
prediction layers past `num_hidden_layers` are skipped.
"""
from __future__ import annotations

import functools

from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.layers.moe.experts import expert_weight_target
from radixserve.layers.norm import ProjectionRMSNorm
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import CausalLM, DecoderLayer, DecoderModel, SkipsMtpLayers
from radixserve.models.moe_blocks import SparseMoeBlock
from radixserve.models.olmo2 import OlmoAttention


def _attention(config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
    return OlmoAttention(config, layer_id, rotary, layer_id, norm=ProjectionRMSNorm)


def _moe(config: ModelConfig, layer_id: int) -> SparseMoeBlock:
    return SparseMoeBlock(config, config.intermediate_size)


class MiniMaxM2ForCausalLM(SkipsMtpLayers, CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, functools.partial(
            DecoderLayer, make_mlp=_moe, make_attention=_attention)))

    @staticmethod
    def weight_target(name: str) -> tuple[str, object] | None:
        for old, new in ((".block_sparse_moe.e_score_correction_bias",
                          ".mlp.gate.e_score_correction_bias"),
                         (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
                         (".block_sparse_moe.", ".mlp.")):
            if old in name:
                name = name.replace(old, new)
                return expert_weight_target(name) or (name, None)
        return None


EntryClass = [MiniMaxM2ForCausalLM]
