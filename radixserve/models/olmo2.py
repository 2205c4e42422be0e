"""OLMo-2, OLMo-3 and OLMo-Hybrid (AI2's fully open models).

  * OLMo-2 (Olmo2ForCausalLM): the Llama block made post-norm, each sublayer's output normed
    before the residual add (post_attention_layernorm, post_feedforward_layernorm); q and k
    RMS-normed over the whole projection (all heads at once), before rope; OLMo's RMSNorm
    multiplies the weight in float32 before the cast.
  * OLMo-3 (Olmo3ForCausalLM): OLMo-2's layer with sliding-window layers in `layer_types` and
    a rope table per layer type.
  * OLMo-Hybrid (OlmoHybridForCausalLM): OLMo-3's attention layers (rope where the config has a
    rope_theta, none otherwise) between pre-norm Gated DeltaNet layers
    (layers/gated_delta_net.py) whose q / k / v / gate / a / b projections are stored apart,
    beta doubled where `linear_allow_neg_eigval` (eigenvalues in [-1, 1]), the output norm's eps
    1e-5; only the attention layers have KV.

Tensor parallelism: the whole-projection q/k norms add the ranks' sums of squares
(layers/norm.OlmoRMSNorm), each rank keeping its heads' slice of the weights.
"""
from __future__ import annotations

import torch
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.layers.gated_delta_net import GatedDeltaNet
from radixserve.layers.linear import RowParallelLinear
from radixserve.layers.merged_linear import QKVParallelLinear
from radixserve.layers.norm import OlmoRMSNorm
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary import RopeInput, RotaryEmbedding
from radixserve.models.blocks import (CausalLM, DecoderModel, KVForAttentionLayers, dense_mlp,
                                      hybrid_layer_types, index_among_type)
from radixserve.models.gemma3 import layer_type_rotary


def _head_slice_loader(head_dim: int, first_head: int, heads: int):
    """A whole-projection norm weight -> this rank's heads' columns."""
    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, first_head * head_dim, heads * head_dim))
    return load


class OlmoAttention(nn.Module):
    def __init__(self, config: ModelConfig, kv_layer_id: int, rotary: RotaryEmbedding | None,
                 layer_id: int, norm: type[OlmoRMSNorm] = OlmoRMSNorm) -> None:
        """norm: the whole-projection q/k norms' class (MiniMax-M2 rounds as Llama does)."""
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim,
                                          config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim,
                                        config.hidden_size, bias=config.attention_bias)
        proj = self.qkv_proj
        self.q_norm = norm(proj.q_size, config.rms_norm_eps,
                           full_width=config.num_attention_heads * head_dim)
        self.k_norm = norm(proj.kv_size, config.rms_norm_eps,
                           full_width=proj.total_num_kv_heads * head_dim,
                           replicas=proj.kv_head_replicas)
        self.q_norm.weight.weight_loader = _head_slice_loader(  # type: ignore[attr-defined]
            head_dim, proj.first_head("q"), proj.num_heads)
        self.k_norm.weight.weight_loader = _head_slice_loader(  # type: ignore[attr-defined]
            head_dim, proj.first_head("k"), proj.num_kv_heads)
        self.rotary = rotary
        self.attn = RadixAttention(proj.num_heads, head_dim, head_dim ** -0.5,
                                   proj.num_kv_heads, kv_layer_id,
                                   sliding_window=config.layer_sliding_window(layer_id))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.q_norm(q), self.k_norm(k)
        rope = None if self.rotary is None else RopeInput(positions, self.rotary)
        return self.o_proj(self.attn(q, k, v, forward_batch, rope))


class OlmoDecoderLayer(nn.Module):
    """Post-norm: h = x + norm(attn(x)); out = h + norm(mlp(h))."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding | None,
                 kv_layer_id: int | None = None) -> None:
        super().__init__()
        self.self_attn = OlmoAttention(config, layer_id if kv_layer_id is None else kv_layer_id,
                                       rotary, layer_id)
        self.mlp = dense_mlp(config)
        self.post_attention_layernorm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, forward_batch: ForwardBatch
                ) -> tuple[torch.Tensor, None]:
        hidden = hidden + self.post_attention_layernorm(
            self.self_attn(positions, hidden, forward_batch))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden)), None


class Olmo2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, OlmoDecoderLayer, OlmoRMSNorm))


class Olmo3ForCausalLM(CausalLM):
    """OLMo-2's layers with windows and a rope table per layer type."""

    def __init__(self, config: ModelConfig) -> None:
        types = list(config.layer_types or ["full_attention"] * config.num_hidden_layers)
        rotaries = {kind: layer_type_rotary(config, kind) if config.layer_rope_parameters
                    else RotaryEmbedding.from_config(config) for kind in dict.fromkeys(types)}

        def make_layer(config: ModelConfig, layer_id: int, _: RotaryEmbedding) -> nn.Module:
            return OlmoDecoderLayer(config, layer_id, rotaries[types[layer_id]])

        super().__init__(config, DecoderModel(config, make_layer, OlmoRMSNorm))


class OlmoLinearAttentionLayer(nn.Module):
    """Pre-norm: h = x + linear_attn(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, state_index: int) -> None:
        super().__init__()
        hf = config.hf
        self.linear_attn = GatedDeltaNet(
            config.hidden_size, hf.linear_num_key_heads, hf.linear_num_value_heads,
            hf.linear_key_head_dim, hf.linear_value_head_dim, hf.linear_conv_kernel_dim,
            1e-5, state_index, grouped_checkpoint=False,
            beta_scale=2.0 if getattr(hf, "linear_allow_neg_eigval", False) else 1.0)
        self.mlp = dense_mlp(config)
        self.input_layernorm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, forward_batch: ForwardBatch
                ) -> tuple[torch.Tensor, None]:
        hidden = hidden + self.linear_attn(self.input_layernorm(hidden), forward_batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), None


# OLMo-Hybrid's linear-attention checkpoint names -> (this layer's parameter, piece)
_LINEAR_ATTN_PIECES = {"q_proj": ("in_proj_qkvz", 0), "k_proj": ("in_proj_qkvz", 1),
                       "v_proj": ("in_proj_qkvz", 2), "g_proj": ("in_proj_qkvz", 3),
                       "b_proj": ("in_proj_ba", 0), "a_proj": ("in_proj_ba", 1),
                       "o_proj": ("out_proj", None), "o_norm": ("norm", None),
                       "q_conv1d": ("conv1d", 0), "k_conv1d": ("conv1d", 1),
                       "v_conv1d": ("conv1d", 2)}
# and its linear-attention layers' norms, as the releases name them
_NORM_NAMES = {".attention_layer_norm.": ".input_layernorm.",
               ".feedforward_layer_norm.": ".post_attention_layernorm."}


class OlmoHybridForCausalLM(KVForAttentionLayers, CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        types = hybrid_layer_types(config)
        theta = (config.rope_parameters or {}).get("rope_theta")
        rotary = RotaryEmbedding.from_config(config) if theta is not None else None

        def make_layer(config: ModelConfig, layer_id: int, _: RotaryEmbedding) -> nn.Module:
            index = index_among_type(types, layer_id)
            if types[layer_id] == "linear_attention":
                return OlmoLinearAttentionLayer(config, index)
            return OlmoDecoderLayer(config, layer_id, rotary, kv_layer_id=index)

        super().__init__(config, DecoderModel(config, make_layer, OlmoRMSNorm))
        for module in self.modules():  # every piece of the merged projections must load
            if isinstance(module, GatedDeltaNet):
                module.in_proj_qkvz.weight.expected_shards = {0, 1, 2, 3}  # type: ignore
                module.in_proj_ba.weight.expected_shards = {0, 1}  # type: ignore
                module.conv1d.weight.expected_shards = {0, 1, 2}  # type: ignore

    @staticmethod
    def weight_target(name: str) -> tuple[str, object] | None:
        for old, new in _NORM_NAMES.items():
            if old in name:
                return name.replace(old, new), None
        head, found, tail = name.partition(".linear_attn.")
        if not found:
            return None
        module, _, rest = tail.partition(".")
        if module not in _LINEAR_ATTN_PIECES:
            return None
        target, piece = _LINEAR_ATTN_PIECES[module]
        return f"{head}.linear_attn.{target}.{rest}", piece


EntryClass = [Olmo2ForCausalLM, Olmo3ForCausalLM, OlmoHybridForCausalLM]
