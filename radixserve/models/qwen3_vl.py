"""Qwen3-VL (Qwen3VLForConditionalGeneration: a Qwen3 language model, q/k norms per head;
Qwen3VLMoeForConditionalGeneration: a Qwen3-MoE one) with its images: models/qwen2_vl.py's
`QwenVLImages` (interleaved multimodal rope, the processor's patches and grids) around the
"qwen3_vl" tower of models/qwen2_vl_vision.py, whose DeepStack mergers give, besides each image
token's features, one row per DeepStack layer that the first decoder layers add to the
residual stream at the image's tokens (transformers' `_deepstack_process`; in a chunked prompt,
at the tokens of the image this pass covers)."""
from __future__ import annotations

from radixserve.core.model_config import ModelConfig
from radixserve.models.qwen2_vl import QwenVLImages
from radixserve.models.qwen3 import Qwen3ForCausalLM
from radixserve.models.qwen_moe import Qwen3MoeForCausalLM


class Qwen3VLForConditionalGeneration(QwenVLImages, Qwen3ForCausalLM):
    tower_kind = "qwen3_vl"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)


class Qwen3VLMoeForConditionalGeneration(QwenVLImages, Qwen3MoeForCausalLM):
    tower_kind = "qwen3_vl"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)


EntryClass = [Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration]
