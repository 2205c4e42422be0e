"""gpt-oss (gpt-oss-20b, gpt-oss-120b): GQA attention with biases on every projection, a
learned sink logit per query head (RadixAttention.sinks), a 128-token window on every other
layer (`layer_types`) and yarn rope; every layer's MLP is a sparse MoE: a router with a bias
(softmax over its top-k logits), experts with biases and a clamped SwiGLU
(layers/activation.ClampedSwiglu), all experts of a layer stored in one tensor per projection,
bf16 or MXFP4 (layers/moe/stacked_experts.py; MXFP4 is dequantised to bf16 at load, or
quantised on to FP8 with --quantization fp8).

Checkpoint names are transformers': `self_attn.sinks` (loaded into the attention layer's
`attn.sinks`, this rank's heads), `mlp.router.{weight,bias}`, `mlp.experts.{gate_up_proj,
down_proj}[_bias | _blocks | _scales]`.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.linear import ReplicatedLinear
from radixserve.layers.moe.router import RoutingConfig, select_experts
from radixserve.layers.moe.stacked_experts import StackedExperts, stacked_expert_target
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.blocks import CausalLM, DecoderAttention, DecoderLayer, DecoderModel


class GptOssAttention(DecoderAttention):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_id, rotary)
        heads = self.attn.tp_q_head_num
        sinks = nn.Parameter(torch.zeros(heads, dtype=torch.float32), requires_grad=False)
        # float32 for the kernels (the checkpoint's bf16 values are exact in it)
        sinks.keep_dtype = True  # type: ignore[attr-defined]
        sinks.weight_loader = functools.partial(  # type: ignore[attr-defined]
            _load_rank_heads, first=get_tp_group().rank * heads)
        self.attn.sinks = sinks


def _load_rank_heads(param: nn.Parameter, loaded: torch.Tensor, first: int) -> None:
    """This rank's heads of a per-head tensor of all heads."""
    heads = param.shape[0]
    if loaded.dim() != 1 or loaded.shape[0] < first + heads:
        raise ValueError(f"sinks of shape {tuple(loaded.shape)} do not hold heads "
                         f"{first}..{first + heads - 1}")
    param.data.copy_(loaded.narrow(0, first, heads))


class GptOssMoE(nn.Module):
    """Router (with bias) -> top-k -> softmax over the k logits -> experts; one all-reduce."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        hf = config.hf
        hidden = config.hidden_size
        # softmax over all logits, then the top k renormalised: softmax over the top-k logits
        self.routing = RoutingConfig(hf.num_local_experts, hf.num_experts_per_tok,
                                     renormalize=True)
        self.router = ReplicatedLinear(hidden, hf.num_local_experts, bias=True, quantize=False)
        method = (getattr(hf, "quantization_config", None) or {}).get("quant_method")
        self.experts = StackedExperts(hf.num_local_experts, hidden, hf.intermediate_size,
                                      "swigluoai", mxfp4=method == "mxfp4",
                                      alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
                                      # older transformers' configs lack it (7.0)
                                      limit=float(getattr(hf, "swiglu_limit", 7.0)))
        self.tp_size = get_tp_group().size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, select_experts(self.router(hidden), self.routing))
        if self.tp_size > 1:
            out = get_tp_group().all_reduce(out)
        return out


class GptOssForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, functools.partial(
            DecoderLayer, make_mlp=GptOssMoE, make_attention=GptOssAttention)))

    @staticmethod
    def weight_target(name: str) -> tuple[str, object] | None:
        if name.endswith(".self_attn.sinks"):
            return name[:-len("sinks")] + "attn.sinks", None
        return stacked_expert_target(name)


EntryClass = [GptOssForCausalLM]
