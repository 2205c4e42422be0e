"""DeepSeek-V2 / V2-Lite / V3 / R1: multi-head latent attention (MLA) and a sparse MoE with
shared experts and group-limited routing (softmax for V2, sigmoid with a correction bias for
V3); the first `first_k_dense_replace` layers are dense.

MLA per layer (per rank: heads split over tensor-parallel ranks, latent replicated):
  q        = q_proj(x) (V2-Lite) or q_b_proj(norm(q_a_proj(x))) (V2)  -> [T, H, nope + rope]
  c, k_pe  = kv_a_proj_with_mqa(x) split [kv_lora_rank | rope]; c = kv_a_layernorm(c)
  rope     = interleaved pairs (DeepSeek's layout; Mistral-4 may pair the halves), yarn
             frequencies and mscale from the config; Mistral-4 scales queries past the original
             context (Llama-4's 1 + beta * log(1 + floor(p / original)))
The pool stores [c | k_pe] per token (576 values for V2). Extend passes decompress every
request's entries with kv_b_proj into per-head K = [k_nope | k_pe], V and attend as MHA; decode
absorbs kv_b_proj into the query (q_nope W_UK, per head [nope] -> [kv_lora_rank]) and the output
(o_latent W_UV^T), so attention runs over the latent entries directly.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.core.forward_batch import ForwardBatch
from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from radixserve.layers.lora import (add_lora_absorbed_output, add_lora_absorbed_query,
                                    add_lora_entries)
from radixserve.layers.moe.experts import expert_weight_target
from radixserve.layers.norm import RMSNorm
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.mem.kv_pool import KVCacheSpec
from radixserve.models.blocks import (CausalLM, DecoderLayer, DecoderModel, SkipsMtpLayers,
                                      dense_mlp)
from radixserve.models.moe_blocks import SparseMoeBlock
from radixserve.models.multimodal_text import LanguageModelOfMultimodal

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a / kv_a layernorms use the RMSNorm default


def yarn_softmax_mscale(config: ModelConfig) -> float:
    """DeepSeek scales attention scores by mscale(factor, mscale_all_dim)^2 under yarn."""
    rope = config.rope_parameters
    all_dim = rope.get("mscale_all_dim", 0)
    factor = rope.get("factor", 1.0)
    if config.rope_type == "default" or not all_dim or factor <= 1:
        return 1.0
    mscale = 0.1 * all_dim * math.log(factor) + 1.0
    return mscale * mscale


def rotate_halves(x: torch.Tensor, positions: torch.Tensor,
                  rotary: RotaryEmbedding) -> torch.Tensor:
    """Rope pairing dim d with d + rope_dim / 2 (the Llama layout; Mistral-4 with
    rope_interleave false), in float32. x: [T, ..., rope_dim]."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rotary.rotary_dim,)
    cos = rotary.cos_cache[positions].view(shape)
    sin = rotary.sin_cache[positions].view(shape)
    first, second = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)


def llama4_query_scale(config: ModelConfig) -> tuple[float, int] | None:
    """(beta, original context) of Llama-4's query scaling where the rope parameters give it
    (Mistral-4): a query at position p is multiplied by 1 + beta * log(1 + floor(p / orig))."""
    beta = config.rope_parameters.get("llama_4_scaling_beta")
    original = config.rope_parameters.get("original_max_position_embeddings")
    return (float(beta), int(original)) if beta and original else None


def rotate_interleaved(x: torch.Tensor, positions: torch.Tensor,
                       rotary: RotaryEmbedding) -> torch.Tensor:
    """Rope over adjacent pairs (x[2i], x[2i+1]) of the last dim, in float32 as DeepSeek does.
    x: [T, ..., rope_dim]; the rotary tables hold cos/sin of each frequency in their first half."""
    half = rotary.rotary_dim // 2
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = rotary.cos_cache[positions, :half].view(shape)
    sin = rotary.sin_cache[positions, :half].view(shape)
    pairs = x.float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = config.hf
        tp_size = get_tp_group().size
        total_heads = config.num_attention_heads
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} heads do not split over {tp_size} ranks")
        self.num_heads = total_heads // tp_size
        self.nope_dim, self.rope_dim = hf.qk_nope_head_dim, hf.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = hf.v_head_dim, hf.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        hidden, bias = config.hidden_size, bool(getattr(hf, "attention_bias", False))
        self.q_lora_rank = getattr(hf, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * self.qk_dim)
        else:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * self.qk_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim,
                                                   bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              total_heads * (self.nope_dim + self.v_dim))
        self.kv_b_proj.weight_read_directly = True  # _up_weights views it in the compute dtype
        self.kv_b_proj.applies_own_lora = True  # LoRA: the add_lora_* calls below
        self.o_proj = RowParallelLinear(total_heads * self.v_dim, hidden, bias=bias)
        self.rotary = rotary
        # DeepSeek's rope pairs adjacent dims; Mistral-4 may pair the two halves instead
        self.interleaved = bool(getattr(hf, "rope_interleave", True))
        self.query_scale = llama4_query_scale(config)
        scaling = self.qk_dim ** -0.5 * yarn_softmax_mscale(config)
        # one latent "KV head" of [latent | rope]; the latent is the value
        self.attn = RadixAttention(self.num_heads, self.kv_lora_rank + self.rope_dim, scaling,
                                   1, layer_id, v_head_dim=self.kv_lora_rank)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, latent], W_UV [H, v, latent]): views of kv_b_proj's weight (of a
        dequantised copy, made once, when it is FP8)."""
        w = self.kv_b_proj.weight
        if self.kv_b_proj.fp8 is not None:
            if getattr(self, "_kv_b_dequantized", None) is None:
                from radixserve.layers.quantization.fp8 import dequantize_weight
                self._kv_b_dequantized = dequantize_weight(
                    w, self.kv_b_proj.weight_scale, self.kv_b_proj.group_k,
                    self.kv_a_layernorm.weight.dtype)
            w = self._kv_b_dequantized
        w = w.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def _rope_and_entries(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                          positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q with its rope part rotated, and the pool entries [latent | rotated k_pe]: one
        Triton kernel on CUDA (layers/kernels/mla_rope.py), else PyTorch."""
        if q.is_cuda and self.interleaved:
            try:
                from radixserve.layers.kernels.mla_rope import mla_rope_and_entries
            except ImportError:
                pass
            else:
                entries = mla_rope_and_entries(q, latent, k_pe, positions,
                                               self.rotary.cos_cache, self.rotary.sin_cache,
                                               self.nope_dim)
                return q, entries
        rotate = rotate_interleaved if self.interleaved else rotate_halves
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat((q_nope, rotate(q_pe, positions, self.rotary)), dim=-1)
        return q, torch.cat((latent, rotate(k_pe, positions, self.rotary)), dim=-1)

    def decompress(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent entries [N, latent + rope] -> K [N, H, nope + rope], V [N, H, v]."""
        latent, k_pe = entries.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = add_lora_entries(self.kv_b_proj, latent,
                              self.kv_b_proj.product(latent, self.kv_b_proj.bias))
        kv = kv.view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
        return k, v.contiguous()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(-1, self.num_heads, self.qk_dim)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank,
                                                              self.rope_dim], dim=-1)
        q, entries = self._rope_and_entries(q, self.kv_a_layernorm(latent.contiguous()), k_pe,
                                            positions)
        if self.query_scale is not None:  # Llama-4's scaling of queries past the context
            beta, original = self.query_scale
            scale = 1 + beta * torch.log1p(torch.floor(positions.float() / original))
            q = q * scale.to(q.dtype).view(-1, 1, 1)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        if forward_batch.forward_mode.is_decode():
            w_uk, w_uv = self._up_weights()
            q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
            q_latent = add_lora_absorbed_query(self.kv_b_proj, q_nope, q_latent)
            out_latent = self.attn.forward_mla_decode(torch.cat((q_latent, q_pe), dim=-1),
                                                      entries, forward_batch)
            out = torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
            out = add_lora_absorbed_output(self.kv_b_proj, out_latent, out, self.nope_dim)
        else:
            out = self.attn.forward_mla_extend(torch.cat((q_nope, q_pe), dim=-1), entries,
                                               self.decompress, forward_batch)
        return self.o_proj(out.reshape(-1, self.num_heads * self.v_dim))


def is_sparse_layer(config: ModelConfig, layer_id: int) -> bool:
    """Whether a layer's MLP is the sparse MoE block: `mlp_layer_types` where the config lists
    them (GLM-4.7-Flash), else every layer from `first_k_dense_replace` on."""
    hf = config.hf
    layer_types = getattr(hf, "mlp_layer_types", None)
    if layer_types:
        return layer_types[layer_id] == "sparse"
    return bool(hf.n_routed_experts) and layer_id >= hf.first_k_dense_replace


def deepseek_mlp(config: ModelConfig, layer_id: int) -> nn.Module:
    """The dense MLP or the MoE block with shared experts and a float32 router (DeepSeek's and
    GLM's)."""
    hf = config.hf
    if not is_sparse_layer(config, layer_id):
        return dense_mlp(config)
    shared = hf.moe_intermediate_size * (hf.n_shared_experts or 0)
    # DeepSeek and GLM route with a float32 router; Mistral-4 in the model's dtype
    return SparseMoeBlock(config, hf.moe_intermediate_size, shared,
                          shared_name="shared_experts",
                          router_fp32=getattr(hf, "model_type", None) != "mistral4")


class DeepseekV2ForCausalLM(CausalLM):
    weight_target = staticmethod(expert_weight_target)
    # MLA's projections load as they are; only the MLPs merge gate|up
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, functools.partial(
            DecoderLayer, make_mlp=deepseek_mlp, make_attention=MLAAttention)))

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig, dtype: torch.dtype,
                      tp_size: int | None = None) -> KVCacheSpec:
        """One latent entry per token per layer, the same on every rank."""
        hf = config.hf
        return KVCacheSpec("mla", config.num_hidden_layers, 1,
                           hf.kv_lora_rank + hf.qk_rope_head_dim, dtype,
                           v_head_dim=hf.kv_lora_rank)


class DeepseekV3ForCausalLM(SkipsMtpLayers, DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (and Kimi-K2, same architecture): V2's MLA and MoE blocks with
    sigmoid noaux_tc routing (moe_blocks.routing_config). The checkpoint's multi-token
    prediction layers (`model.layers.{num_hidden_layers + i}`, for speculative decoding) are
    skipped: we decode one token per step."""

    halved_rope = False  # rope over the halves (`rope_interleave` false): refused here

    def __init__(self, config: ModelConfig) -> None:
        if not self.halved_rope and not getattr(config.hf, "rope_interleave", True):
            raise ValueError("DeepSeek-V3 with rope_interleave false is not supported (the "
                             "released checkpoints use DeepSeek's interleaved rope pairs)")
        super().__init__(config)


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    """Mistral-4: DeepSeek-V3's layers with softmax routing (groups ranked by their two best
    scores, no correction bias, a router in the model's dtype), rope over adjacent pairs or
    halves (`rope_interleave`), and Llama-4's query scaling past the original context."""

    halved_rope = True


class Mistral4ForConditionalGeneration(LanguageModelOfMultimodal, Mistral4ForCausalLM):
    """Mistral Small 4's multimodal checkpoints (Mistral3ForConditionalGeneration around a
    Mistral-4 decoder, chosen by models/registry.model_class), served text-only."""


EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Mistral4ForCausalLM,
              Mistral4ForConditionalGeneration]
