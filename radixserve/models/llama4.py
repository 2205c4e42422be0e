"""Llama 4 (Scout 17B-16E, Maverick 17B-128E): Llama4ForCausalLM, and the multimodal
Llama4ForConditionalGeneration checkpoints served text-only (their vision tower skipped).

Attention, by layer (`no_rope_layers[i]` is 1 where layer i uses rope, transformers' naming):
  * rope layers (three of four): rope over adjacent pairs (x[2i], x[2i+1]) with llama3
    scaling, then an L2 norm of each q and k head without a weight (`use_qk_norm`: Scout; the
    norm commutes with the rotation, so the backends norm before rope as for Qwen3), over
    chunks of `attention_chunk_size` positions (the query at p sees keys (p // C) * C..p:
    RadixAttention.attention_chunk, which every backend honours);
  * NoPE layers (every fourth): no rope, the whole context, and each query scaled by
    log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 (`attn_temperature_tuning`), 1 up to
    position floor_scale - 2.
The pair rotation is brought to the halves layout (x[i], x[i + D/2]) every rope kernel here
takes by permuting each head's q and k rows at load (`RopePairsQKV`): q.k is unchanged, as
both are permuted alike, and v and o are untouched (what Hugging Face's conversion of Meta's
Llama checkpoints did).

Feed-forward: MoE on `moe_layers` (all of Scout's; every other of Maverick's), a dense SwiGLU
of `intermediate_size_mlp` elsewhere. The router takes one expert per token with weight
sigmoid(its logit), which scales the token on its way into the expert (not the expert's
output: the experts are not linear), plus a shared expert every token takes. Checkpoints name
the block `feed_forward` (`router`, `experts.gate_up_proj` [E, H, 2I] and `experts.down_proj`
[E, I, H] stacked, or per expert in FP8 releases, `shared_expert`).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.core.model_config import ModelConfig
from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.linear import ReplicatedLinear
from radixserve.layers.moe.experts import FusedMoE, expert_weight_target
from radixserve.layers.moe.router import RoutingConfig, TopK, select_experts
from radixserve.layers.norm import RMSNorm
from radixserve.layers.quantization.int4 import current_int4_config
from radixserve.layers.rope_pairs import RopePairsQKV
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import (CausalLM, DecoderAttention, DecoderLayer, DecoderModel,
                                      dense_mlp, renamed_target)
from radixserve.models.multimodal_text import LanguageModelOfMultimodal

RENAMES = ((".feed_forward.", ".mlp."),)


class UnitRMSNorm(RMSNorm):
    """RMSNorm without a learned scale (Llama-4's q/k L2 norm): its weight is a buffer of
    ones, which no checkpoint holds and the fused q/k norm kernels read as any weight."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        nn.Module.__init__(self)
        self.register_buffer("weight", torch.ones(hidden_size), persistent=False)
        self.variance_epsilon = eps


class Llama4Attention(DecoderAttention):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        hf = config.hf
        uses_rope = bool(hf.no_rope_layers[layer_id])
        chunked = bool(config.layer_types) and \
            config.layer_types[layer_id] == "chunked_attention"
        super().__init__(config, layer_id, rotary if uses_rope else None,
                         qkv_linear=RopePairsQKV,
                         attention_chunk=hf.attention_chunk_size if chunked else None)
        if uses_rope and hf.use_qk_norm:
            self.q_norm = UnitRMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = UnitRMSNorm(config.head_dim, config.rms_norm_eps)
        # NoPE layers: (floor_scale, attn_scale) of the query's temperature
        self.temperature = (float(hf.floor_scale), float(hf.attn_scale)) \
            if hf.attn_temperature_tuning and not uses_rope else None

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               forward_batch: ForwardBatch, kv_stored: bool = False) -> torch.Tensor:
        if self.temperature is None:
            return super().attend(positions, qkv, forward_batch, kv_stored)
        q, k, v = self.qkv_proj.split(qkv)
        floor_scale, attn_scale = self.temperature
        scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * \
            attn_scale + 1.0
        q = (q.view(q.shape[0], -1, self.head_dim) * scale[:, None, None]).to(q.dtype)
        return self.attn(q.view(q.shape[0], -1), k, v, forward_batch, None)


class Llama4MoE(nn.Module):
    """Top-1 routed experts with the router's weight on the expert's input, plus the shared
    expert; one all-reduce of the two partial sums."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf
        if hf.num_experts_per_tok != 1:  # the weight scales the input: one expert a token
            raise ValueError(f"Llama-4 routing to {hf.num_experts_per_tok} experts a token is "
                             "not supported (its released models route to 1)")
        self.routing = RoutingConfig(hf.num_local_experts, 1, scoring="sigmoid")
        self.router = ReplicatedLinear(config.hidden_size, hf.num_local_experts, quantize=False)
        self.experts = FusedMoE(hf.num_local_experts, config.hidden_size, hf.intermediate_size,
                                getattr(hf, "hidden_act", "silu"))
        self.shared_expert = dense_mlp(config, hf.intermediate_size, reduce_results=False)
        self.tp_size = get_tp_group().size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk = select_experts(self.router(hidden), self.routing)
        routed_in = hidden * topk.weights.to(hidden.dtype)  # [T, 1]: the chosen expert's
        out = self.experts(routed_in, TopK(torch.ones_like(topk.weights), topk.ids))
        out = out + self.shared_expert(hidden)
        if self.tp_size > 1:
            out = get_tp_group().all_reduce(out)
        return out


def llama4_mlp(config: ModelConfig, layer_id: int) -> nn.Module:
    if layer_id in config.hf.moe_layers:
        return Llama4MoE(config)
    return dense_mlp(config, config.hf.intermediate_size_mlp)


class Llama4ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        if current_int4_config() is not None:  # packed rows cannot be permuted at load
            raise ValueError("int4 (AWQ / GPTQ) checkpoints of Llama-4 are not supported")
        super().__init__(config, DecoderModel(config, functools.partial(
            DecoderLayer, make_mlp=llama4_mlp, make_attention=Llama4Attention)))

    def weight_target(self, name: str) -> tuple[str, object] | None:
        """`feed_forward` is `mlp` here; its experts stacked or one by one."""
        found = expert_weight_target(name.replace(".feed_forward.", ".mlp."),
                                     inputs_first=True)
        if found is not None:
            return found
        return renamed_target(name, RENAMES, self.packed_modules_mapping)


class Llama4ForConditionalGeneration(LanguageModelOfMultimodal, Llama4ForCausalLM):
    """Llama-4's released (multimodal) checkpoints: the language model, served text-only."""


EntryClass = [Llama4ForCausalLM, Llama4ForConditionalGeneration]
