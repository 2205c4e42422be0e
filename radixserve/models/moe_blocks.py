"""The sparse MoE block the MoE families share, and their per-family routing settings.

  SparseMoeBlock  router (`gate`, replicated) -> top-k -> routed experts (`experts`, FusedMoE)
                  + optional shared expert(s) (`shared_expert` / `shared_experts`, a GatedMLP)
                  optionally scaled by sigmoid(`shared_expert_gate`(x)) (Qwen2-MoE);
                  every part leaves its tensor-parallel partial sum and the block all-reduces
                  once.
Checkpoint names stay the families' own: Qwen and DeepSeek `mlp.gate`, `mlp.experts.{e}.*`
(DeepSeek-V3's float32 `mlp.gate.e_score_correction_bias` beside the router weight);
Mixtral's and PhiMoE's `block_sparse_moe` is renamed to `mlp` by `mixtral.py`.
"""
from __future__ import annotations

import torch
from torch import nn

from radixserve.core.model_config import ModelConfig
from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.linear import ReplicatedLinear
from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.moe.router import RoutingConfig, select_experts
from radixserve.models.blocks import dense_mlp


def routing_config(config: ModelConfig) -> RoutingConfig:
    """Each family's routing from its HF config fields."""
    hf = config.hf
    arch = config.architecture
    if arch in ("MixtralForCausalLM", "GraniteMoeHybridForCausalLM", "GraniteMoeForCausalLM",
                "GraniteMoeSharedForCausalLM"):  # top-k softmax
        return RoutingConfig(hf.num_local_experts, hf.num_experts_per_tok, renormalize=True)
    if arch == "PhimoeForCausalLM":  # sparsemixer: two masked softmaxes, top-2
        return RoutingConfig(hf.num_local_experts, hf.num_experts_per_tok,
                             scoring="sparsemixer", jitter_eps=float(hf.router_jitter_noise))
    if arch == "MiniMaxM2ForCausalLM":  # sigmoid + correction bias, renormalised, no groups
        scoring = getattr(hf, "scoring_func", None) or "sigmoid"
        if scoring != "sigmoid":
            raise ValueError(f"{arch} routing {scoring!r} is not supported (only sigmoid)")
        return RoutingConfig(hf.num_local_experts, hf.num_experts_per_tok, renormalize=True,
                             scoring="sigmoid")
    if arch == "NemotronHForCausalLM":  # V3's routing (sigmoid, groups by their best two)
        return RoutingConfig(hf.n_routed_experts, hf.num_experts_per_tok,
                             renormalize=bool(hf.norm_topk_prob), num_groups=hf.n_group or 1,
                             topk_group=hf.topk_group or 1,
                             scaling_factor=float(hf.routed_scaling_factor), scoring="sigmoid")
    # transformers' V3 and GLM-4.5 routers: always sigmoid + noaux_tc
    if arch.startswith(("DeepseekV3", "Glm4Moe")):
        scoring = getattr(hf, "scoring_func", None) or "sigmoid"
        method = getattr(hf, "topk_method", None) or "noaux_tc"
        if scoring != "sigmoid" or method != "noaux_tc":
            raise ValueError(f"{arch} routing {scoring}/{method} is not supported "
                             "(only sigmoid scores with noaux_tc)")
        return RoutingConfig(hf.n_routed_experts, hf.num_experts_per_tok,
                             renormalize=bool(getattr(hf, "norm_topk_prob", True)),
                             num_groups=hf.n_group or 1, topk_group=hf.topk_group or 1,
                             scaling_factor=float(hf.routed_scaling_factor), scoring="sigmoid")
    if getattr(hf, "model_type", None) == "mistral4":  # also inside Mistral Small 4's
        # multimodal architecture: softmax, groups by their two best scores, no bias
        return RoutingConfig(hf.n_routed_experts, hf.num_experts_per_tok,
                             renormalize=bool(getattr(hf, "norm_topk_prob", True)),
                             num_groups=hf.n_group or 1, topk_group=hf.topk_group or 1,
                             scaling_factor=float(hf.routed_scaling_factor),
                             group_score="top2_sum")
    if arch.startswith("DeepseekV2"):
        grouped = getattr(hf, "topk_method", "greedy") == "group_limited_greedy"
        return RoutingConfig(hf.n_routed_experts, hf.num_experts_per_tok,
                             renormalize=bool(getattr(hf, "norm_topk_prob", False)),
                             num_groups=hf.n_group if grouped else 1,
                             topk_group=hf.topk_group if grouped else 1,
                             scaling_factor=float(hf.routed_scaling_factor))
    # Qwen3.5-MoE's and Qwen3-VL-MoE's routers always renormalise, whatever the config says
    renormalize = getattr(hf, "model_type", "").startswith(("qwen3_5_moe", "qwen3_vl_moe")) or \
        bool(getattr(hf, "norm_topk_prob", False))
    return RoutingConfig(hf.num_experts, hf.num_experts_per_tok, renormalize=renormalize)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, expert_intermediate_size: int,
                 shared_intermediate_size: int = 0, shared_name: str = "shared_expert",
                 shared_gate: bool = False, router_fp32: bool = False) -> None:
        """router_fp32: routing logits from a float32 copy of the router (DeepSeek keeps its
        router weights in float32)."""
        super().__init__()
        self.routing = routing_config(config)
        hidden = config.hidden_size
        self.gate = ReplicatedLinear(hidden, self.routing.num_experts, quantize=False)
        if self.routing.scoring == "sigmoid":  # checkpoint: mlp.gate.e_score_correction_bias
            bias = nn.Parameter(torch.zeros(self.routing.num_experts, dtype=torch.float32),
                                requires_grad=False)
            # float32 as transformers and vLLM keep it: it only moves the choice, whose gaps
            # between experts bf16 rounding would reorder
            bias.keep_dtype = True  # type: ignore[attr-defined]
            self.gate.e_score_correction_bias = bias
        self.router_fp32 = router_fp32
        if router_fp32:  # forward reads the router's weight itself
            self.gate.weight_read_directly = True
        self.experts = FusedMoE(self.routing.num_experts, hidden, expert_intermediate_size,
                                getattr(config.hf, "hidden_act", "silu"))
        self.shared_name = shared_name if shared_intermediate_size else None
        if shared_intermediate_size:
            setattr(self, shared_name, dense_mlp(config, shared_intermediate_size,
                                                 reduce_results=False))
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, quantize=False) \
            if shared_gate else None
        self.tp_size = get_tp_group().size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.router_fp32:
            logits = torch.nn.functional.linear(hidden.float(), self.gate.weight.float())
        else:
            logits = self.gate(hidden)
        bias = getattr(self.gate, "e_score_correction_bias", None)
        out = self.experts(hidden, select_experts(logits, self.routing, bias))
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        if self.tp_size > 1:
            out = get_tp_group().all_reduce(out)
        return out
