"""The language model of a multimodal checkpoint, served text-only (Mistral Small 4, Llama-4;
LLaVA's, Gemma-3's and Mistral Small 3.1 / 3.2's images are read, models/image_features.py,
with these prefixes for their language models): `ModelConfig.hf` is its `text_config`; the
checkpoint names the decoder `language_model.model.*` (the hub's layout, which transformers
still saves) or `model.language_model.*` (transformers' module names, which some fine-tunes
saved), an untied LM head `language_model.lm_head.weight` or `lm_head.weight`; the vision tower
and the multimodal projector (under `model.` or not) have no place here. Requests with images
are refused where they arrive (the chat route's and Engine.chat's content parts, /generate's
image_data)."""
from __future__ import annotations

# a multimodal checkpoint's tensors that are not its language model's (after an optional
# "model.")
VISION_PREFIXES = ("vision_tower.", "vision_model.", "multi_modal_projector.")


class LanguageModelOfMultimodal:
    """Mixin in front of a CausalLM (the text family's class): the checkpoint's prefixes
    renamed (loader/weight_loading.py's `checkpoint_prefixes`), the vision tensors skipped."""

    checkpoint_prefixes = {"language_model.model.": "model.",
                           "language_model.lm_head.": "lm_head.",
                           "model.language_model.": "model."}

    def skip_weight(self, name: str) -> bool:
        return name.removeprefix("model.").startswith(VISION_PREFIXES) or \
            super().skip_weight(name)  # type: ignore[misc]
