"""The Llama family: Llama 2/3/3.1, Mistral (sliding window), Qwen2 (q/k/v bias), SmolLM."""
from __future__ import annotations

from radixserve.config import ModelConfig
from radixserve.models.blocks import CausalLM, DecoderLayer, DecoderModel


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, DecoderLayer))


EntryClass = [LlamaForCausalLM]
