"""Gemma-3 text models (Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b): Gemma-2's layer (GeGLU,
embeddings scaled by sqrt(hidden_size), (1 + weight) RMSNorms before and after attention and
MLP, queries scaled by query_pre_attn_scalar ** -0.5, tied embeddings) with a (1 + weight)
RMSNorm over each head of q and k before rope, sliding-window and full-attention layers in
`layer_types` (five to one), and a rope table per layer type: sliding layers rotate by a local
base (10k), full layers by the global one (1M; linearly scaled in the 4b-27b language models).
Soft-capping as Gemma-2 where the config sets it (Gemma-3's do not).

Gemma3ForConditionalGeneration (gemma-3-4b/12b/27b, -it and -pt): the language model of
`text_config` (ModelConfig.hf) with a SigLIP vision tower (models/vision_towers.py) and
Gemma-3's projector. An image is SigLIP's last_hidden_state (after its post_layernorm), the
patch grid average-pooled to `mm_tokens_per_image` rows, (1 + weight) RMS-normed and projected
to the text width (`Gemma3Projector`); the rows replace the embeddings of the image's
<image_soft_token>s, unscaled (text rows are scaled by sqrt(hidden_size)), as LLaVA's do
(models/image_features.py `ReadsImages`: the feature cache, the checkpoint layouts). An image's
tokens attend to every token of the same image (transformers' mask with the token_type_ids its
processor makes; in sliding layers, within the window): the attention backend reads which
tokens a pass's tokens see from `ForwardBatch.extend_causal_limit` (core/multimodal.py
`image_attention_limits`), which the runner sets for a pass with images (from
`VisionSpec.bidirectional`). Passes without images, decode among them, run as
Gemma3ForCausalLM's."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.core.forward_batch import ForwardBatch
from radixserve.layers.norm import GemmaRMSNorm
from radixserve.layers.rotary import RopeInput, RotaryEmbedding, default_inv_freq
from radixserve.models.blocks import CausalLM, DecoderAttention, DecoderModel
from radixserve.models.gemma2 import Gemma2DecoderLayer
from radixserve.models.image_features import ReadsImages
from radixserve.models.vision_towers import VisionTower


def layer_type_rotary(config: ModelConfig, layer_type: str) -> RotaryEmbedding:
    """The rope table of one layer type, from its entry of rope_parameters (transformers' own
    frequency function for a scaled kind, with the layer type, as its Gemma-3 does)."""
    params = config.layer_rope_parameters[layer_type]
    kind = params.get("rope_type", "default")
    if kind == "default":
        inv_freq, factor = default_inv_freq(config.head_dim, params["rope_theta"]), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config.hf, "cpu", layer_type=layer_type)
    return RotaryEmbedding(config.head_dim, config.rope_positions, inv_freq.float(),
                           float(factor))


class Gemma3Attention(DecoderAttention):
    """Attention whose q and k heads are normed by Gemma's (1 + weight) RMSNorm before rope.
    The norms run here, not in the backend's fused rope + store kernel (Qwen3's `QKNorm`),
    which scales by the weight itself."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 scaling: float | None = None, logit_cap: float = 0.0) -> None:
        super().__init__(config, layer_id, rotary, scaling=scaling, logit_cap=logit_cap)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               forward_batch: ForwardBatch, kv_stored: bool = False) -> torch.Tensor:
        assert not kv_stored, "rope_store never carries Gemma-3's q/k norms"
        q, k, v = self.qkv_proj.split(qkv)
        tokens, head_dim = q.shape[0], self.head_dim
        q = self.q_norm(q.reshape(-1, head_dim)).view(tokens, -1)
        k = self.k_norm(k.reshape(-1, head_dim)).view(tokens, -1)
        return self.attn(q, k, v, forward_batch, RopeInput(positions, self.rotary))


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma-2's four-norm layer around Gemma3Attention."""
    attention_cls = Gemma3Attention


class Gemma3Model(DecoderModel):
    """DecoderModel whose layers rotate by their layer type's rope table."""

    def __init__(self, config: ModelConfig) -> None:
        if getattr(config.hf, "use_bidirectional_attention", False):
            raise ValueError("Gemma-3 with use_bidirectional_attention (an embedding model) "
                             "is not a causal LM")
        types: list[str] = list(config.layer_types or ())  # Gemma3TextConfig fills them in
        rotaries = {kind: layer_type_rotary(config, kind) for kind in dict.fromkeys(types)}

        def make_layer(config: ModelConfig, layer_id: int, _: RotaryEmbedding) -> nn.Module:
            return Gemma3DecoderLayer(config, layer_id, rotaries[types[layer_id]])

        super().__init__(config, make_layer, GemmaRMSNorm, embed_scale=config.hidden_size ** 0.5)
        # the table DecoderModel built from the top-level rope parameters is used by no layer
        self.rotary = rotaries.get("full_attention", next(iter(rotaries.values())))


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, Gemma3Model(config))


class Gemma3Projector(nn.Module):
    """Gemma-3's multi_modal_projector: the tower's [side x side] patch grid average-pooled to
    mm_tokens_per_image rows, Gemma's (1 + weight) RMSNorm (eps: the tower's layer_norm_eps),
    then times `mm_input_projection_weight` [vision hidden, text hidden]."""

    def __init__(self, vision_config: Any, tokens_per_image: int, text_hidden: int) -> None:
        super().__init__()
        self.patches_per_side = vision_config.image_size // vision_config.patch_size
        tokens_per_side = math.isqrt(tokens_per_image)
        if tokens_per_side ** 2 != tokens_per_image or \
                self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {tokens_per_image} is not a square grid "
                             f"pooled from the tower's {self.patches_per_side}x"
                             f"{self.patches_per_side} patches")
        self.kernel = self.patches_per_side // tokens_per_side
        hidden = vision_config.hidden_size
        self.mm_input_projection_weight = nn.Parameter(torch.empty(hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(hidden, vision_config.layer_norm_eps)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[n, side * side, vision hidden] -> [n, mm_tokens_per_image, text hidden]."""
        n, _, hidden = patches.shape
        side = self.patches_per_side
        grid = patches.transpose(1, 2).reshape(n, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, hidden)).view(n, -1, hidden)
        return normed @ self.mm_input_projection_weight


class Gemma3ForConditionalGeneration(ReadsImages, Gemma3ForCausalLM):
    """A multimodal Gemma-3 checkpoint: the language model, the tower and the projector."""

    def __init__(self, config: ModelConfig) -> None:
        top = config.hf_top
        vision = top.vision_config
        if vision.model_type != "siglip_vision_model":
            raise ValueError(f"Gemma3ForConditionalGeneration with a {vision.model_type!r} "
                             "vision tower is not supported (supported: siglip_vision_model)")
        super().__init__(config)
        self.vision_tower = VisionTower(vision, [vision.num_hidden_layers], post_layernorm=True)
        self.multi_modal_projector = Gemma3Projector(vision, int(top.mm_tokens_per_image),
                                                     config.hidden_size)

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] pixels -> [n, mm_tokens_per_image, hidden] in the model's dtype."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        return self.multi_modal_projector(self.vision_tower(
            pixel_values.to(weight.device, weight.dtype)))


EntryClass = [Gemma3ForCausalLM, Gemma3ForConditionalGeneration]
