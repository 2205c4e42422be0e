"""LLaVA-style checkpoints (LlavaForConditionalGeneration: llava-hf/llava-1.5-7b-hf and the like,
mistral-community/pixtral-12b): a CLIP, SigLIP (models/vision_towers.py) or Pixtral
(models/pixtral_vision.py) vision tower, a two-layer MLP projector, and a Llama, Mistral or Qwen2
language model (`text_config`, ModelConfig.hf) built as Llama's.

An image becomes the rows of its placeholder tokens (core/multimodal.py's `vision_spec` says how
many): the tower's hidden states after `vision_feature_layer`, less the first token (CLIP's class
token) under the "default" select strategy, projected to the text width (`encode_images`).
A Pixtral tower takes images of any size whose sides are multiples of its patch: one of H x W
pixels gives its own (H / patch) x (W / patch) patches, row-major, every one kept (transformers
5.25's `get_image_features` passes `image_sizes` to the tower, which crops each image to its
size, then splits the projected features by those counts; no spatial merge), laid out in the
prompt as Pixtral's rows of image tokens and breaks (`ImageInput.grid`). Its "default" strategy
is refused: transformers drops the first patch of the whole packed batch, not of each image.
Writing the features over the placeholders' embeddings, the cache of encoded images and the
checkpoint layouts (Pixtral's tensors straight under `vision_tower.`: `FLAT_TOWER_PREFIXES`) are
models/image_features.py's (`ReadsImages`)."""
from __future__ import annotations

import torch
from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.models.blocks import CausalLM, DecoderLayer, DecoderModel
from radixserve.models.image_features import CACHED_IMAGES, FLAT_TOWER_PREFIXES, ReadsImages
from radixserve.models.pixtral_vision import PixtralVisionTower
from radixserve.models.vision_towers import (TOWER_KINDS, VisionTower, activation,
                                             hidden_state_indices)

TEXT_KINDS = ("llama", "mistral", "qwen2")
SELECT_STRATEGIES = ("default", "full")
PIXTRAL = "pixtral"  # pixtral-12b's tower: images of any size, Pixtral's layout
__all__ = ["CACHED_IMAGES", "LlavaForConditionalGeneration", "LlavaProjector"]


class LlavaProjector(nn.Module):
    """linear_1 -> projector_hidden_act -> linear_2: vision features to the text width."""

    def __init__(self, in_size: int, out_size: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_size, out_size, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(out_size, out_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(ReadsImages, CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        top = config.hf_top
        vision = top.vision_config
        text_kind = config.hf.model_type
        if text_kind not in TEXT_KINDS:
            raise ValueError(f"LlavaForConditionalGeneration with a {text_kind!r} language "
                             f"model is not supported (supported: {', '.join(TEXT_KINDS)})")
        pixtral = vision.model_type == PIXTRAL
        if vision.model_type not in TOWER_KINDS and not pixtral:
            raise ValueError(f"LlavaForConditionalGeneration with a {vision.model_type!r} "
                             f"vision tower is not supported (supported: "
                             f"{', '.join((*TOWER_KINDS, PIXTRAL))})")
        strategy = getattr(top, "vision_feature_select_strategy", "default")
        if strategy not in SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported "
                             f"(supported: {', '.join(SELECT_STRATEGIES)})")
        if pixtral and strategy != "full":
            raise ValueError(f"vision_feature_select_strategy {strategy!r} with a Pixtral "
                             "tower is not supported (supported: full)")
        super().__init__(config, DecoderModel(config, DecoderLayer))
        layers = hidden_state_indices(top.vision_feature_layer, vision.num_hidden_layers)
        self.vision_tower: VisionTower | PixtralVisionTower
        if pixtral:
            self.vision_tower = PixtralVisionTower(vision, layers)
            self.checkpoint_prefixes = FLAT_TOWER_PREFIXES
        else:
            self.vision_tower = VisionTower(vision, layers)
        self.multi_modal_projector = LlavaProjector(
            self.vision_tower.feature_size, config.hidden_size, top.projector_hidden_act,
            bool(getattr(top, "multimodal_projector_bias", True)))
        self.drops_first_token = strategy == "default"

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] pixels (one size) -> [n, features, hidden] in the model's dtype:
        tokens_per_image rows, or a Pixtral tower's (H / patch) * (W / patch), row-major."""
        weight = self.multi_modal_projector.linear_1.weight
        features = self.vision_tower(pixel_values.to(weight.device, weight.dtype))
        if self.drops_first_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)


EntryClass = [LlavaForConditionalGeneration]
