"""Qwen3-Next and Qwen3.5: hybrid models of linear and full attention.

`layer_types` names each layer's token mixer:
  * "linear_attention": a Gated DeltaNet (layers/gated_delta_net.py), whose per-request states
    live in the RecurrentStatePool, not in the KV pool;
  * "full_attention" (one layer in four in the releases): gated attention, the q projection
    giving each head its query and an output gate (attention * sigmoid(gate) before o_proj),
    (1 + weight) RMSNorms over each q and k head, rope over the first quarter of each head
    (`partial_rotary_factor`). Only these layers have KV: they are numbered 0.. in the KV pool.
Every RMSNorm of the stream is (1 + weight) in float32 (Gemma's). The MLP is dense (Qwen3.5)
or Qwen2-MoE's sparse block with a sigmoid-gated shared expert (Qwen3-Next, Qwen3.5-MoE).

Qwen3.5 ships as Qwen3_5(Moe)ForConditionalGeneration, a vision tower beside the language
model: its images are read as Qwen2.5-VL's are (models/qwen2_vl.py `QwenVLImages`), their tokens
at 3-D positions of the interleaved multimodal rope (text alone: ordinary rope). The
checkpoints' multi-token-prediction tensors (`mtp.*`) are skipped.
"""
from __future__ import annotations

import torch
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.layers.gated_delta_net import GatedDeltaNet
from radixserve.layers.linear import RowParallelLinear
from radixserve.layers.merged_linear import QKVParallelLinear
from radixserve.layers.moe.experts import expert_weight_target
from radixserve.layers.norm import GemmaRMSNorm
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary import RopeInput, RotaryEmbedding
from radixserve.models.blocks import (CausalLM, DecoderModel, KVForAttentionLayers,
                                      PreNormMixerLayer, dense_mlp, hybrid_layer_types,
                                      index_among_type)
from radixserve.models.qwen2_vl import QwenVLImages
from radixserve.models.qwen_moe import qwen_mlp


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, kv_layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim,
                                          config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias,
                                          q_rows_per_head=2 * head_dim)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim,
                                        config.hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = RadixAttention(self.qkv_proj.num_heads, head_dim, head_dim ** -0.5,
                                   self.qkv_proj.num_kv_heads, kv_layer_id)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        tokens, head_dim = hidden.shape[0], self.head_dim
        q, gate = q_gate.view(tokens, -1, 2 * head_dim).split(head_dim, dim=-1)
        q = self.q_norm(q.reshape(-1, head_dim)).view(tokens, -1)
        k = self.k_norm(k.reshape(-1, head_dim)).view(tokens, -1)
        out = self.attn(q, k, v, forward_batch, RopeInput(positions, self.rotary))
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))


class HybridDecoderLayer(PreNormMixerLayer):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf, types = config.hf, hybrid_layer_types(config)
        index = index_among_type(types, layer_id)
        if types[layer_id] == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                config.hidden_size, hf.linear_num_key_heads, hf.linear_num_value_heads,
                hf.linear_key_head_dim, hf.linear_value_head_dim, hf.linear_conv_kernel_dim,
                config.rms_norm_eps, index, grouped_checkpoint=hf.model_type == "qwen3_next")
        elif types[layer_id] == "full_attention":
            self.self_attn = GatedAttention(config, index, rotary)
        else:
            raise ValueError(f"layer type {types[layer_id]!r} is not served")
        self.mlp = qwen_mlp(config, layer_id) if getattr(hf, "num_experts", 0) else \
            dense_mlp(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def mix(self, positions: torch.Tensor, normed: torch.Tensor,
            forward_batch: ForwardBatch) -> torch.Tensor:
        if hasattr(self, "linear_attn"):
            return self.linear_attn(normed, forward_batch)
        return self.self_attn(positions, normed, forward_batch)


class Qwen3NextForCausalLM(KVForAttentionLayers, CausalLM):
    weight_target = staticmethod(expert_weight_target)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, HybridDecoderLayer, GemmaRMSNorm))

    def skip_weight(self, name: str) -> bool:
        return name.startswith("mtp.") or super().skip_weight(name)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's decoder: q | k | v, z, b and a of the linear attention stored apart."""

    packed_modules_mapping = {
        **CausalLM.packed_modules_mapping,
        "in_proj_qkv": ("in_proj_qkvz", "qkv"), "in_proj_z": ("in_proj_qkvz", 3),
        "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1),
    }


class Qwen3_5ForConditionalGeneration(QwenVLImages, Qwen3_5ForCausalLM):
    """Qwen3.5 and Qwen3.5-MoE releases with their images (models/qwen2_vl.py: the tower is
    `model.visual`, resampled position embeddings; interleaved multimodal rope)."""
    tower_kind = "qwen3_5"


EntryClass = [Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration]
