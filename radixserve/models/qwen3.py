"""Qwen3 (dense): the Llama block with an RMSNorm over each head of q and k before rope, and no
q/k/v bias."""
from __future__ import annotations

import functools

from radixserve.core.model_config import ModelConfig
from radixserve.models.blocks import CausalLM, DecoderLayer, DecoderModel


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, functools.partial(DecoderLayer,
                                                                         qk_norm=True)))


EntryClass = [Qwen3ForCausalLM]
