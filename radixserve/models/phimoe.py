"""PhiMoE (Phi-3.5-MoE, Phi-mini-MoE, Phi-tiny-MoE): Mixtral's layout with

  norms    LayerNorms with a bias (`layers/norm.LayerNorm`), before attention, before the MoE
           and at the end
  attention bias on q, k, v and o; LongRoPE's two tables where the config names them
           (core/long_rope.py)
  routing  `sparsemixer` top-2 (layers/moe/router.py): each chosen expert weighted by a
           softmax over the experts near it, not renormalised
  head     untied, with a bias (`lm_head_bias`)

Checkpoints use Mixtral's names (`block_sparse_moe.gate`, `experts.{e}.w1/w2/w3`).
"""
from __future__ import annotations

from radixserve.core.model_config import ModelConfig
from radixserve.layers.embedding import ParallelLMHead
from radixserve.layers.norm import LayerNorm
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import CausalLM, DecoderLayer, DecoderModel
from radixserve.models.mixtral import MixtralForCausalLM, mixtral_moe


class PhimoeLayer(DecoderLayer):
    """Mixtral's layer behind LayerNorms with biases."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_id, rotary, make_mlp=mixtral_moe)
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)


class PhimoeForCausalLM(CausalLM):
    weight_target = staticmethod(MixtralForCausalLM.weight_target)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, PhimoeLayer, norm_cls=LayerNorm))
        if self.lm_head is not None and getattr(config.hf, "lm_head_bias", False):
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=True)


EntryClass = [PhimoeForCausalLM]
