"""LLaVA-1.5-style checkpoints (LlavaForConditionalGeneration: llava-hf/llava-1.5-7b-hf and the
like): a CLIP or SigLIP vision tower (models/vision_towers.py), a two-layer MLP projector, and a
Llama, Mistral or Qwen2 language model (`text_config`, ModelConfig.hf) built as Llama's.

An image becomes the rows of its placeholder tokens (core/multimodal.py's `vision_spec` says how
many): the tower's hidden states after `vision_feature_layer`, less the first token (CLIP's class
token) under the "default" select strategy, projected to the text width (`encode_images`). An
extend pass embeds its tokens, then writes over the rows of the placeholders it covers the
image's feature rows for those positions; a prompt chunked over several passes encodes each
image once (features kept by image hash, the `CACHED_IMAGES` most recently used). Passes
without images, decode among them, run as CausalLM's.

Checkpoint layouts: the hub's (`language_model.model.*`, `language_model.lm_head.*`,
`vision_tower.vision_model.*`, `multi_modal_projector.*`), what transformers 5 saves (the same
with the tower's tensors straight under `vision_tower.`) and its module names
(`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`,
`lm_head.*`). The vision tower and projector are plain modules, replicated on every
tensor-parallel rank and loaded whole."""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.core.multimodal import ImageInput
from radixserve.layers.logits import LogitsOutput, compute_logits, pooled_last_token
from radixserve.models.blocks import CausalLM, DecoderLayer, DecoderModel
from radixserve.models.multimodal_text import LanguageModelOfMultimodal
from radixserve.models.vision_towers import (TOWER_KINDS, VisionTower, activation,
                                             hidden_state_indices)

TEXT_KINDS = ("llama", "mistral", "qwen2")
SELECT_STRATEGIES = ("default", "full")
CACHED_IMAGES = 16  # encoded images kept per model, least recently used dropped first
_VISION = "vision_tower.vision_model."


class LlavaProjector(nn.Module):
    """linear_1 -> projector_hidden_act -> linear_2: vision features to the text width."""

    def __init__(self, in_size: int, out_size: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_size, out_size, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(out_size, out_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ImageSpan(NamedTuple):
    """The rows of one image's placeholders that a pass covers."""
    image: ImageInput
    row: int  # the first of them among the pass's tokens
    feature_row: int  # the image's feature row that goes there
    length: int


def image_spans(forward_batch: ForwardBatch) -> list[ImageSpan]:
    """Where the images of an extend pass land: request i's tokens are its prompt positions
    [prefix_len, prefix_len + extend_len), packed request after request; an image's feature row
    j belongs at prompt position offset + j."""
    assert forward_batch.mm_inputs is not None
    assert forward_batch.extend_prefix_lens_cpu is not None
    assert forward_batch.extend_seq_lens_cpu is not None
    spans, start = [], 0
    for images, prefix_len, extend_len in zip(forward_batch.mm_inputs,
                                              forward_batch.extend_prefix_lens_cpu,
                                              forward_batch.extend_seq_lens_cpu):
        for image in images:
            first = max(prefix_len, image.offset)
            end = min(prefix_len + extend_len, image.end)
            if first < end:
                spans.append(ImageSpan(image, start + first - prefix_len, first - image.offset,
                                       end - first))
        start += extend_len
    return spans


class LlavaForConditionalGeneration(CausalLM):
    checkpoint_prefixes = {
        **LanguageModelOfMultimodal.checkpoint_prefixes,
        "model.vision_tower.vision_model.": _VISION,
        "model.vision_tower.": _VISION,
        _VISION: _VISION,
        "vision_tower.": _VISION,
        "model.multi_modal_projector.": "multi_modal_projector.",
    }

    def __init__(self, config: ModelConfig) -> None:
        top = config.hf_top
        vision = top.vision_config
        text_kind = config.hf.model_type
        if text_kind not in TEXT_KINDS:
            raise ValueError(f"LlavaForConditionalGeneration with a {text_kind!r} language "
                             f"model is not supported (supported: {', '.join(TEXT_KINDS)})")
        if vision.model_type not in TOWER_KINDS:
            raise ValueError(f"LlavaForConditionalGeneration with a {vision.model_type!r} "
                             f"vision tower is not supported (supported: "
                             f"{', '.join(TOWER_KINDS)})")
        strategy = getattr(top, "vision_feature_select_strategy", "default")
        if strategy not in SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported "
                             f"(supported: {', '.join(SELECT_STRATEGIES)})")
        super().__init__(config, DecoderModel(config, DecoderLayer))
        layers = hidden_state_indices(top.vision_feature_layer, vision.num_hidden_layers)
        self.vision_tower = VisionTower(vision, layers)
        self.multi_modal_projector = LlavaProjector(
            self.vision_tower.feature_size, config.hidden_size, top.projector_hidden_act,
            bool(getattr(top, "multimodal_projector_bias", True)))
        self.drops_first_token = strategy == "default"
        # image hash -> its features [tokens, hidden] on the model's device, oldest use first
        self.image_cache: OrderedDict[int, torch.Tensor] = OrderedDict()

    def skip_weight(self, name: str) -> bool:
        if name.startswith("vision_tower."):
            return self.vision_tower.skip_weight(name.removeprefix("vision_tower."))
        return super().skip_weight(name)

    def weight_target(self, name: str) -> tuple[str, object] | None:
        """The tower's and projector's tensors load whole under their own names (the packed
        mapping's q_proj / k_proj / v_proj are the decoder's)."""
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return name, None
        return None

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] pixels -> [n, tokens_per_image, hidden] features in the model's dtype."""
        weight = self.multi_modal_projector.linear_1.weight
        features = self.vision_tower(pixel_values.to(weight.device, weight.dtype))
        if self.drops_first_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def image_features(self, images: list[ImageInput]) -> dict[int, torch.Tensor]:
        """Features by image hash: cached ones, the rest encoded (one batch per pixel shape)
        and cached."""
        found: dict[int, torch.Tensor] = {}
        missing: dict[tuple[int, ...], dict[int, ImageInput]] = {}
        for image in images:
            if image.hash in self.image_cache:
                self.image_cache.move_to_end(image.hash)
                found[image.hash] = self.image_cache[image.hash]
            else:
                missing.setdefault(tuple(image.pixel_values.shape), {})[image.hash] = image
        for group in missing.values():
            pixels = torch.stack([image.pixel_values for image in group.values()])
            for key, features in zip(group, self.encode_images(pixels)):
                # a copy: a view would keep the whole batch alive while one image stays cached
                found[key] = self.image_cache[key] = features.clone()
                if len(self.image_cache) > CACHED_IMAGES:
                    self.image_cache.popitem(last=False)
        return found

    def input_embeds(self, input_ids: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """The pass's token embeddings, the rows of image placeholders replaced by the images'
        features (placeholder ids past the vocabulary embed as token 0 first)."""
        vocab = self.config.vocab_size
        embeds = self.model.embed_tokens(torch.where(input_ids < vocab, input_ids, 0))
        spans = image_spans(forward_batch)
        features = self.image_features([span.image for span in spans])
        for image, row, feature_row, length in spans:
            rows = features[image.hash]
            if rows.shape[0] != image.num_tokens:
                raise ValueError(f"an image fills {image.num_tokens} placeholders; its "
                                 f"features are {rows.shape[0]} rows")
            embeds[row:row + length] = rows[feature_row:feature_row + length].to(embeds.dtype)
        return embeds

    def decoder_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       forward_batch: ForwardBatch) -> torch.Tensor:
        """The language model's final hidden states, images written into its input."""
        embeds = self.input_embeds(input_ids, forward_batch) if has_images(forward_batch) \
            else None
        return self.final_hidden(self.model(input_ids, positions, forward_batch,
                                            input_embeds=embeds))

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              forward_batch: ForwardBatch) -> torch.Tensor:
        return pooled_last_token(self.decoder_hidden(input_ids, positions, forward_batch),
                                 forward_batch)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsOutput:
        if not has_images(forward_batch):
            return super().forward(input_ids, positions, forward_batch)
        return compute_logits(self.decoder_hidden(input_ids, positions, forward_batch),
                              self._head(), forward_batch, self.final_logit_cap)


def has_images(forward_batch: ForwardBatch) -> bool:
    return forward_batch.mm_inputs is not None and forward_batch.forward_mode.is_extend()


EntryClass = [LlavaForConditionalGeneration]
