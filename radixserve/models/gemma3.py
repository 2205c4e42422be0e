"""Gemma-3 text models (Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b): Gemma-2's layer (GeGLU,
embeddings scaled by sqrt(hidden_size), (1 + weight) RMSNorms before and after attention and
MLP, queries scaled by query_pre_attn_scalar ** -0.5, tied embeddings) with a (1 + weight)
RMSNorm over each head of q and k before rope, sliding-window and full-attention layers in
`layer_types` (five to one), and a rope table per layer type: sliding layers rotate by a local
base (10k), full layers by the global one (1M; linearly scaled in the 4b-27b language models).
Soft-capping as Gemma-2 where the config sets it (Gemma-3's do not).

Gemma3ForConditionalGeneration (gemma-3-4b/12b/27b, -it and -pt: a SigLIP vision tower and a
projector beside the language model) is served text-only: the language model of `text_config`
(ModelConfig.hf), the vision tensors skipped; requests with images are refused where they
arrive (the chat route's and Engine.chat's content parts, /generate's image_data)."""
from __future__ import annotations

import torch
from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.core.forward_batch import ForwardBatch
from radixserve.layers.norm import GemmaRMSNorm
from radixserve.layers.rotary import RopeInput, RotaryEmbedding, default_inv_freq
from radixserve.models.blocks import CausalLM, DecoderAttention, DecoderModel
from radixserve.models.gemma2 import Gemma2DecoderLayer
from radixserve.models.multimodal_text import LanguageModelOfMultimodal


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


class Gemma3ForConditionalGeneration(LanguageModelOfMultimodal, Gemma3ForCausalLM):
    """A multimodal Gemma-3 checkpoint's language model (models/multimodal_text.py)."""


EntryClass = [Gemma3ForCausalLM, Gemma3ForConditionalGeneration]
