"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (Glm4MoeForCausalLM) and GLM-4.7-Flash (Glm4MoeLiteForCausalLM).

GLM-4.5: GQA attention with q/k/v bias (none on o_proj), optional per-head q/k RMSNorms
(`use_qk_norm`) and rope over the first half of each head (`partial_rotary_factor` 0.5, neox
layout); the first `first_k_dense_replace` layers are dense, the rest DeepSeek-V3's MoE block
(sigmoid scores with a correction bias, renormalised and scaled top-k, one shared expert).
GLM-4.7-Flash: DeepSeek-V3's MLA attention with that MoE block, dense or sparse per layer as
`mlp_layer_types` says. Both ship multi-token prediction layers past `num_hidden_layers`
(speculative decoding), which are skipped.
"""
from __future__ import annotations

import functools

from radixserve.core.model_config import ModelConfig
from radixserve.layers.moe.experts import expert_weight_target
from radixserve.models.blocks import CausalLM, DecoderLayer, DecoderModel, SkipsMtpLayers
from radixserve.models.deepseek_v2 import DeepseekV3ForCausalLM, deepseek_mlp


class Glm4MoeForCausalLM(SkipsMtpLayers, CausalLM):
    weight_target = staticmethod(expert_weight_target)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, functools.partial(
            DecoderLayer, qk_norm=bool(getattr(config.hf, "use_qk_norm", False)),
            make_mlp=deepseek_mlp)))


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3's layers; which are sparse comes from `mlp_layer_types`
    (deepseek_v2.is_sparse_layer)."""


EntryClass = [Glm4MoeForCausalLM, Glm4MoeLiteForCausalLM]
