"""Architecture name (HF config "architectures") -> model class, imported on first use.

Every model class has one constructor signature, `cls(config: ModelConfig)`. Adding a family is
a module under models/ and one line here."""
from __future__ import annotations

import importlib

import torch
from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.mem.kv_pool import KVCacheSpec, spec_bytes_per_token

# architecture -> (module under radixserve.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("llama", "Phi3ForCausalLM"),
    "SmolLM3ForCausalLM": ("llama", "SmolLM3ForCausalLM"),
    "CohereForCausalLM": ("cohere", "CohereForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "GraniteMoeForCausalLM": ("granite", "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("granite", "GraniteMoeForCausalLM"),
    "Cohere2ForCausalLM": ("cohere", "Cohere2ForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ("llama4", "Llama4ForConditionalGeneration"),
    "Mistral3ForConditionalGeneration": ("llama", "Mistral3ForConditionalGeneration"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "PhimoeForCausalLM": ("phimoe", "PhimoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("glm4_moe", "Glm4MoeLiteForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Mistral4ForCausalLM": ("deepseek_v2", "Mistral4ForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("olmo2", "Olmo3ForCausalLM"),
    "OlmoHybridForCausalLM": ("olmo2", "OlmoHybridForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granite_hybrid", "GraniteMoeHybridForCausalLM"),
    "BambaForCausalLM": ("granite_hybrid", "BambaForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_next", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_next", "Qwen3_5ForConditionalGeneration"),
}


# decoder checkpoints without an LM head (embedding models: e5-mistral's MistralModel,
# Qwen2Model, ...): served by the ForCausalLM class with --is-embedding, which leaves
# the head out
HEADLESS_ARCHITECTURES: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
    "GemmaModel": "GemmaForCausalLM", "Gemma2Model": "Gemma2ForCausalLM",
}

# (architecture, its language model's model_type) -> another class than the architecture's:
# a multimodal architecture whose checkpoints carry different language models
_BY_TEXT_MODEL: dict[tuple[str, str], tuple[str, str]] = {
    # Mistral Small 4: Mistral3ForConditionalGeneration around a Mistral-4 (MLA + MoE) decoder
    ("Mistral3ForConditionalGeneration", "mistral4"):
        ("deepseek_v2", "Mistral4ForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    architecture = HEADLESS_ARCHITECTURES.get(architecture, architecture)
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"radixserve.models.{module}"), name)


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class serving this config: its architecture's, or where a multimodal architecture
    holds another language model, that one's (`_BY_TEXT_MODEL`)."""
    text_kind = getattr(config.hf, "model_type", None)
    override = _BY_TEXT_MODEL.get((config.architecture, text_kind or ""))
    if override is not None:
        module, name = override
        return getattr(importlib.import_module(f"radixserve.models.{module}"), name)
    return get_model_class(config.architecture)


def kv_cache_spec(config: ModelConfig, dtype: torch.dtype, tp_size: int = 1) -> KVCacheSpec:
    """What the model's KV pool stores per token (the model class decides)."""
    return model_class(config).kv_cache_spec(  # type: ignore[attr-defined]
        config, dtype, tp_size)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of KV one token takes in all layers, from the pool class that will hold it."""
    return spec_bytes_per_token(kv_cache_spec(config, dtype, tp_size))
