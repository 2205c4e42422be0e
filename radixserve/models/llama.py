"""The Llama family: Llama 2/3/3.1, Mistral (sliding window), Qwen2 (q/k/v bias), SmolLM, Phi-3 /
Phi-4 (merged checkpoint tensors), SmolLM3 (NoPE layers); and
Mistral Small 3.1 / 3.2's multimodal checkpoints (Mistral3ForConditionalGeneration): a Pixtral
vision tower (models/pixtral_vision.py) and Mistral3's projector (models/mistral3_projector.py)
beside a Mistral language model (`text_config`, ModelConfig.hf) built as Llama's.

An image of processed size H x W (sides multiples of patch_size * spatial_merge_size, as
PixtralImageProcessor makes them; its own size, not a batch's padded one) becomes
rows x cols = H / (patch * merge) x W / (patch * merge) feature rows, row-major: the tower's
hidden state after `vision_feature_layer` (transformers' hidden_states index: 0 ln_pre's
output, -1 the last layer's), normed, merged merge x merge and projected (`encode_images`).
The prompt holds them as Pixtral's layout, each row's image tokens then [IMG_BREAK], the last
row's [IMG_END] (`ImageInput.grid`); the features replace the image tokens' embeddings, the
breaks keep theirs (models/image_features.py `ReadsImages`: placement, the cache of encoded
images). Ministral 3's checkpoints share the architecture with another language model (its
`llama_4_scaling` of attention, not implemented): refused; Mistral Small 4's (a Mistral-4
decoder) take deepseek_v2's class (registry.model_class), served text-only."""
from __future__ import annotations

import functools

import torch

from radixserve.core.model_config import ModelConfig
from radixserve.layers.merged_linear import ALL_PIECES
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import CausalLM, DecoderAttention, DecoderLayer, DecoderModel
from radixserve.models.image_features import FLAT_TOWER_PREFIXES, ReadsImages
from radixserve.models.mistral3_projector import Mistral3Projector
from radixserve.models.pixtral_vision import PixtralVisionTower
from radixserve.models.vision_towers import hidden_state_indices


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, DecoderLayer))


def _smollm3_attention(config: ModelConfig, layer_id: int,
                       rotary: RotaryEmbedding) -> DecoderAttention:
    """SmolLM3: `no_rope_layers[i]` is 1 where layer i uses rope (every fourth does not)."""
    uses_rope = bool(config.hf.no_rope_layers[layer_id])
    return DecoderAttention(config, layer_id, rotary if uses_rope else None)


class SmolLM3ForCausalLM(CausalLM):
    """SmolLM3: Llama's layer, without positional encoding on every fourth layer (NoPE)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, functools.partial(
            DecoderLayer, make_attention=_smollm3_attention)))


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5-mini and Phi-4: Llama's layer, its checkpoints storing q|k|v
    (`self_attn.qkv_proj`) and gate|up (`mlp.gate_up_proj`) as one tensor each, loaded piece
    by piece (merged_linear.ALL_PIECES; FP8 scales alike). Windows as the config names them
    (Phi-3-mini's 2047); the long-context releases' `longrope` tables and their switch per
    request: core/long_rope.py."""

    def weight_target(self, name: str) -> tuple[str, object] | None:
        if name.rsplit(".", 2)[-2] in ("qkv_proj", "gate_up_proj"):
            return name, ALL_PIECES
        return None


class Mistral3ForConditionalGeneration(ReadsImages, LlamaForCausalLM):
    """Mistral Small 3.1 / 3.2: the language model, the Pixtral tower and the projector."""

    # the tower's tensors lie straight under vision_tower. (no vision_model level)
    checkpoint_prefixes = FLAT_TOWER_PREFIXES

    def __init__(self, config: ModelConfig) -> None:
        top = config.hf_top
        kind = getattr(config.hf, "model_type", "mistral")
        if kind != "mistral":
            raise ValueError(f"Mistral3ForConditionalGeneration with a {kind!r} language model "
                             "is not supported (only Mistral Small 3.1 / 3.2's 'mistral')")
        vision = top.vision_config
        if getattr(vision, "model_type", None) != "pixtral":
            raise ValueError(f"Mistral3ForConditionalGeneration with a {vision.model_type!r} "
                             "vision tower is not supported (supported: pixtral)")
        layers = hidden_state_indices(getattr(top, "vision_feature_layer", -1),
                                      vision.num_hidden_layers)
        if len(layers) != 1:  # transformers' norm and merger are sized for one
            raise ValueError(f"vision_feature_layer {top.vision_feature_layer!r}: Mistral3's "
                             "projector reads one layer")
        super().__init__(config)
        self.vision_tower = PixtralVisionTower(vision, layers)
        self.multi_modal_projector = Mistral3Projector(top, config.hidden_size,
                                                       config.rms_norm_eps)
        self.grid_patch = vision.patch_size * self.multi_modal_projector.merge

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] pixels of one size -> [n, H / grid_patch * W / grid_patch, hidden],
        row-major, in the model's dtype."""
        height, width = pixel_values.shape[-2:]
        if height % self.grid_patch or width % self.grid_patch:
            raise ValueError(f"image of {height}x{width} pixels; Mistral3 takes sides that are "
                             f"multiples of {self.grid_patch} (patch x spatial merge)")
        weight = self.multi_modal_projector.linear_1.weight
        patches = self.vision_tower(pixel_values.to(weight.device, weight.dtype))
        patch = self.vision_tower.patch_size
        return self.multi_modal_projector(patches, height // patch, width // patch)


EntryClass = [LlamaForCausalLM, SmolLM3ForCausalLM, Phi3ForCausalLM,
              Mistral3ForConditionalGeneration]
