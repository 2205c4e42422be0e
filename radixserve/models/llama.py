"""The Llama family: Llama 2/3/3.1, Mistral (sliding window), Qwen2 (q/k/v bias), SmolLM; and
Mistral Small 3.1 / 3.2's multimodal checkpoints (Mistral3ForConditionalGeneration), whose
Mistral language model is served text-only (models/multimodal_text.py)."""
from __future__ import annotations

from radixserve.core.model_config import ModelConfig
from radixserve.models.blocks import CausalLM, DecoderLayer, DecoderModel
from radixserve.models.multimodal_text import LanguageModelOfMultimodal


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, DecoderLayer))


class Mistral3ForConditionalGeneration(LanguageModelOfMultimodal, LlamaForCausalLM):
    """Mistral Small 3.1 / 3.2 (a Pixtral vision tower beside a Mistral decoder), text-only.
    Mistral Small 4's checkpoints (a Mistral-4 decoder) take deepseek_v2's class
    (registry.model_class); Ministral 3's share the architecture with another language model
    (its `llama_4_scaling` of attention, not implemented): refused."""

    def __init__(self, config: ModelConfig) -> None:
        kind = getattr(config.hf, "model_type", "mistral")
        if kind != "mistral":
            raise ValueError(f"Mistral3ForConditionalGeneration with a {kind!r} language model "
                             "is not supported (only Mistral Small 3.1 / 3.2's 'mistral')")
        super().__init__(config)


EntryClass = [LlamaForCausalLM, Mistral3ForConditionalGeneration]
