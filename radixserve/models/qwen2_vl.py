"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration):
a Qwen2 language model (q/k/v bias; `text_config`, ModelConfig.hf) built as Llama's, whose rope
is multimodal (`mrope_section`: layers/rotary.py `MRotaryEmbedding`), and the vision tower of
models/qwen2_vl_vision.py.

An image is the processor's patches and grid; its span in the prompt is (h / merge) x (w /
merge) <|image_pad|> tokens (the chat template writes one between <|vision_start|> and
<|vision_end|>; core/multimodal.py expands it by the processed size), which the tower's merged
rows replace (models/image_features.py `ReadsImages`: the feature cache, writing the rows).

Positions (transformers' `get_rope_index`): an image's tokens take (temporal, row, column)
positions from the position after the text before it; the text after it continues from the
largest of them plus one, so it trails its index by the image's `rope_delta`. A pass whose
requests have images runs inside the rotary's per-token tables of those 3-D positions
(core/multimodal.py `mrope_positions`); every other pass, decode among them, is plain rope at
1-D positions that carry the shift (`ForwardBatch.position_offsets`), so decode keeps its CUDA
graphs and fused kernels.

Checkpoint layouts: the hub's (`model.*` the language model, `visual.*`, `lm_head.*`) and
transformers 5's module names (`model.language_model.*`, `model.visual.*`)."""
from __future__ import annotations

from typing import Any

import torch

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.core.multimodal import ImageInput, mrope_positions
from radixserve.layers.rotary import MRotaryEmbedding
from radixserve.models.blocks import CausalLM, DecoderLayer, DecoderModel
from radixserve.models.image_features import ReadsImages, has_images
from radixserve.models.qwen2_vl_vision import QwenVisionTower

_VISUAL = "visual."


class QwenVLImages(ReadsImages):
    """Mixin in front of a CausalLM whose DecoderModel's rope is multimodal: the Qwen VL tower
    (`tower_kind`), its checkpoint names, the images' 3-D positions in a pass with images."""

    checkpoint_prefixes = {"model.language_model.": "model.", "model.visual.": _VISUAL}
    tower_kind = "qwen2_vl"  # models/qwen2_vl_vision.py TOWER_KINDS
    visual: QwenVisionTower

    def __init__(self, config: ModelConfig, *args: Any) -> None:
        super().__init__(config, *args)
        if not isinstance(self.model.rotary, MRotaryEmbedding):
            raise ValueError(f"{config.architecture} without mrope_section in its rope "
                             "parameters is not supported")
        self.visual = QwenVisionTower(config.hf_top.vision_config, self.tower_kind)

    def skip_weight(self, name: str) -> bool:
        # the CausalLM's own rules (past ReadsImages', which are LLaVA's names)
        return not name.startswith(_VISUAL) and super(ReadsImages, self).skip_weight(name)

    def weight_target(self, name: str) -> tuple[str, object] | None:
        """The tower's tensors load whole under their own names; the rest as the CausalLM's."""
        if name.startswith(_VISUAL):
            return name, None
        parent = getattr(super(ReadsImages, self), "weight_target", None)
        return parent(name) if parent is not None else None

    @torch.no_grad()
    def encode_group(self, images: list[ImageInput]) -> torch.Tensor:
        """Images of one grid -> [n, rows * cols, hidden] in the model's dtype."""
        thw = images[0].thw
        assert thw is not None, "a Qwen2-VL image carries its grid"
        merge = self.visual.merge
        weight = self.visual.patch_embed.proj.weight
        pixels = torch.stack([image.pixel_values for image in images])
        return self.visual(pixels.to(weight.device), (thw[0], thw[1] * merge, thw[2] * merge))

    def decoder_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       forward_batch: ForwardBatch) -> torch.Tensor:
        """The language model's final hidden states, images written into its input and their
        tokens at their 3-D positions."""
        if not has_images(forward_batch):
            return self.final_hidden(self.model(input_ids, positions, forward_batch))
        embeds, additions = self.embeds_and_deepstack(input_ids, forward_batch)
        assert forward_batch.extend_prefix_lens_cpu is not None
        assert forward_batch.extend_seq_lens_cpu is not None
        offsets = forward_batch.position_offsets or [0] * forward_batch.batch_size
        positions_3d = mrope_positions(forward_batch.mm_inputs or [],
                                       forward_batch.extend_prefix_lens_cpu,
                                       forward_batch.extend_seq_lens_cpu, offsets)
        rotary: Any = self.model.rotary
        with rotary.per_token_tables(positions_3d) as table_rows:
            hidden = self.model(input_ids, table_rows, forward_batch, input_embeds=embeds,
                                layer_additions=additions)
        return self.final_hidden(hidden)

    def embeds_and_deepstack(self, input_ids: torch.Tensor, forward_batch: ForwardBatch
                             ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]
                                        | None]:
        """The pass's embeddings with the images' features written over their pads, and for a
        tower with DeepStack layers (Qwen3-VL) what each of the first decoder layers adds to
        those rows (the features' further column blocks, in order)."""
        embeds, at, extra = self.embeds_and_extra_columns(input_ids, forward_batch)
        if at is None or extra is None:
            return embeds, None
        width = embeds.shape[-1]
        return embeds, [(at, extra[:, i * width:(i + 1) * width])
                        for i in range(len(self.visual.deepstack_layers))]


class Qwen2VLForConditionalGeneration(QwenVLImages, CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, DecoderLayer))


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    tower_kind = "qwen2_5_vl"


EntryClass = [Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration]
