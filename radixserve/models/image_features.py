"""What the models that read images share (LLaVA, Gemma-3, Mistral3): `ReadsImages`, a mixin in
front of a CausalLM with a vision tower and a projector.

An extend pass embeds its tokens as the language model does (scaled where it scales; image ids
past the vocabulary embedded as token 0), then writes over the rows of the image tokens it
covers the image's feature rows for those positions (`image_spans`: request i's tokens are its
prompt positions [prefix_len, prefix_len + extend_len), packed request after request; the
feature row at prompt position p is `ImageInput.feature_index(p)`: p - offset, or in Pixtral's
layout (`ImageInput.grid`) the row-major index of p's cell, its break / end tokens keeping their
text embeddings). A prompt chunked over several passes encodes each image once: features are
kept by image hash, the `CACHED_IMAGES` most recently used. Passes without images, decode among
them, run as the CausalLM's.

Checkpoint layouts (`CHECKPOINT_PREFIXES`): the hub's (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`), what
transformers 5 saves (the same with the tower's tensors straight under `vision_tower.`) and its
module names (`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`,
`lm_head.*`); a tower without the `vision_model` level (Pixtral's) takes `FLAT_TOWER_PREFIXES`,
its tensors straight under `vision_tower.`. The tower and projector are plain modules,
replicated on every tensor-parallel rank and loaded whole under their own names."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.core.multimodal import ImageInput
from radixserve.layers.logits import LogitsOutput, compute_logits, pooled_last_token
from radixserve.models.multimodal_text import LanguageModelOfMultimodal

CACHED_IMAGES = 16  # encoded images kept per model, least recently used dropped first
# images a tower call takes at most: a pass's images beyond it are encoded in several calls, so
# the tower's activations stay bounded (a Gemma-3 image is 4,096 patches through SigLIP; the
# memory budget reserves none for it)
ENCODE_BATCH = 8
_VISION = "vision_tower.vision_model."
CHECKPOINT_PREFIXES = {
    **LanguageModelOfMultimodal.checkpoint_prefixes,
    "model.vision_tower.vision_model.": _VISION,
    "model.vision_tower.": _VISION,
    _VISION: _VISION,
    "vision_tower.": _VISION,
    "model.multi_modal_projector.": "multi_modal_projector.",
}
# a tower named straight under vision_tower. (Pixtral: no vision_model level)
FLAT_TOWER_PREFIXES = {
    **LanguageModelOfMultimodal.checkpoint_prefixes,
    "vision_tower.": "vision_tower.",
    "multi_modal_projector.": "multi_modal_projector.",
    "model.vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
}


class ImageSpan(NamedTuple):
    """The tokens of one image's span that a pass covers."""
    image: ImageInput
    row: int  # the first of them among the pass's tokens
    start: int  # its place in the image's span (prompt position - offset)
    length: int

    def placement(self, device: torch.device) -> tuple[slice | torch.Tensor,
                                                       slice | torch.Tensor]:
        """(rows among the pass's tokens, the image's feature rows that go there): slices
        where every token of the span is a feature row, else index tensors over the image
        tokens alone (`ImageInput.feature_index`, vectorised)."""
        if self.image.grid is None:
            return (slice(self.row, self.row + self.length),
                    slice(self.start, self.start + self.length))
        cols = self.image.grid[1]
        within = torch.arange(self.start, self.start + self.length, device=device)
        cell_row, cell_col = within // (cols + 1), within % (cols + 1)
        image_tokens = cell_col < cols
        return ((within - self.start + self.row)[image_tokens],
                (cell_row * cols + cell_col)[image_tokens])


def image_spans(forward_batch: ForwardBatch) -> list[ImageSpan]:
    """Where the images of an extend pass land among its tokens."""
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


def has_images(forward_batch: ForwardBatch) -> bool:
    return forward_batch.mm_inputs is not None and forward_batch.forward_mode.is_extend()


class ReadsImages:
    """Mixin in front of a CausalLM: subclasses build the tower and projector and define
    `encode_images`."""

    checkpoint_prefixes = CHECKPOINT_PREFIXES
    config: ModelConfig
    model: Any  # the DecoderModel
    vision_tower: Any  # a VisionTower

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # image hash -> its features [tokens, hidden] on the model's device, oldest use first
        self.image_cache: OrderedDict[int, torch.Tensor] = OrderedDict()

    def skip_weight(self, name: str) -> bool:
        if name.startswith("vision_tower."):
            return self.vision_tower.skip_weight(name.removeprefix("vision_tower."))
        return super().skip_weight(name)  # type: ignore[misc]

    def weight_target(self, name: str) -> tuple[str, object] | None:
        """The tower's and projector's tensors load whole under their own names (the packed
        mapping's q_proj / k_proj / v_proj are the decoder's)."""
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return name, None
        return None

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] pixels (images of one size) -> [n, features, hidden] in the model's
        dtype, `ImageInput.num_features` rows an image."""
        raise NotImplementedError

    def encode_group(self, images: list[ImageInput]) -> torch.Tensor:
        """Images of one pixel shape and grid -> [n, features, hidden] (`encode_images` of
        their stacked pixels; a tower that needs their grid reads it here)."""
        return self.encode_images(torch.stack([image.pixel_values for image in images]))

    def image_features(self, images: list[ImageInput]) -> dict[int, torch.Tensor]:
        """Features by image hash: cached ones, the rest encoded (batches of one pixel shape,
        at most ENCODE_BATCH images) and cached."""
        found: dict[int, torch.Tensor] = {}
        missing: dict[tuple[Any, ...], dict[int, ImageInput]] = {}
        for image in images:
            if image.hash in self.image_cache:
                self.image_cache.move_to_end(image.hash)
                found[image.hash] = self.image_cache[image.hash]
            else:
                shape = (tuple(image.pixel_values.shape), image.grid, image.thw)
                missing.setdefault(shape, {})[image.hash] = image
        for group in missing.values():
            keys = list(group)
            for start in range(0, len(keys), ENCODE_BATCH):
                batch = keys[start:start + ENCODE_BATCH]
                for key, features in zip(batch, self.encode_group([group[k] for k in batch])):
                    # a copy: a view would keep the whole batch alive while one image stays
                    # cached
                    found[key] = self.image_cache[key] = features.clone()
                    if len(self.image_cache) > CACHED_IMAGES:
                        self.image_cache.popitem(last=False)
        return found

    def text_embeds(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The pass's tokens embedded as the language model embeds them (and scales them,
        Gemma), ids past the vocabulary (an image token of some configs) as token 0."""
        decoder = self.model
        hidden = decoder.embed_tokens(torch.where(input_ids < self.config.vocab_size,
                                                  input_ids, 0))
        if decoder.embed_scale is not None:
            hidden = hidden * torch.tensor(decoder.embed_scale, dtype=hidden.dtype)
        return hidden

    def input_embeds(self, input_ids: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """The pass's token embeddings, the rows of image placeholders replaced by the images'
        features."""
        return self.embeds_and_extra_columns(input_ids, forward_batch)[0]

    def embeds_and_extra_columns(self, input_ids: torch.Tensor, forward_batch: ForwardBatch
                                 ) -> tuple[torch.Tensor, torch.Tensor | None,
                                            torch.Tensor | None]:
        """`input_embeds`, and where the features are wider than the embeddings (Qwen3-VL's
        DeepStack rows after its main features) the pass's rows they went to [R] and their
        further columns [R, extra]; None, None otherwise."""
        embeds = self.text_embeds(input_ids)
        width = embeds.shape[-1]
        spans = image_spans(forward_batch)
        features = self.image_features([span.image for span in spans])
        at, extras = [], []
        for span in spans:
            image, rows = span.image, features[span.image.hash]
            if rows.shape[0] != image.num_features:
                raise ValueError(f"an image has {image.num_features} image tokens; its "
                                 f"features are {rows.shape[0]} rows")
            into, taken = span.placement(embeds.device)
            own = rows[taken]
            embeds[into] = own[:, :width].to(embeds.dtype)
            if own.shape[1] > width:
                at.append(torch.arange(embeds.shape[0], device=embeds.device)[into])
                extras.append(own[:, width:])
        if not extras:
            return embeds, None, None
        return embeds, torch.cat(at), torch.cat(extras)

    def decoder_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       forward_batch: ForwardBatch) -> torch.Tensor:
        """The language model's final hidden states, images written into its input."""
        embeds = None
        if has_images(forward_batch):
            embeds = self.input_embeds(input_ids, forward_batch)
        return self.final_hidden(  # type: ignore[attr-defined]
            self.model(input_ids, positions, forward_batch, input_embeds=embeds))

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              forward_batch: ForwardBatch) -> torch.Tensor:
        return pooled_last_token(self.decoder_hidden(input_ids, positions, forward_batch),
                                 forward_batch)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsOutput:
        if not has_images(forward_batch):
            return super().forward(input_ids, positions, forward_batch)  # type: ignore[misc]
        return compute_logits(self.decoder_hidden(input_ids, positions, forward_batch),
                              self._head(), forward_batch,  # type: ignore[attr-defined]
                              self.final_logit_cap)  # type: ignore[attr-defined]
