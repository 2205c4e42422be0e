"""The sparse MoE block the MoE families share, and their per-family routing settings.

  SparseMoeBlock  router (`gate`, replicated) -> top-k -> routed experts (`experts`, FusedMoE)
                  + optional shared expert(s) (`shared_expert` / `shared_experts`, a GatedMLP)
                  optionally scaled by sigmoid(`shared_expert_gate`(x)) (Qwen2-MoE);
                  every part leaves its tensor-parallel partial sum and the block all-reduces
                  once.
Checkpoint names stay the families' own: Qwen and DeepSeek `mlp.gate`, `mlp.experts.{e}.*`;
Mixtral's `block_sparse_moe` is renamed to `mlp` by `mixtral.py`.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from radixserve.config import ModelConfig
from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.linear import ReplicatedLinear
from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.moe.router import RoutingConfig, select_experts
from radixserve.models.blocks import dense_mlp

# one-row decode of MoE layers with the norm and the residual add in the products (DecoderLayer
# .forward_fused): off until timed on a GPU (RADIXSERVE_MOE_ROW_FUSION=1 turns it on)
ROW_FUSION = os.environ.get("RADIXSERVE_MOE_ROW_FUSION", "0") != "0"


def routing_config(config: ModelConfig) -> RoutingConfig:
    """Each family's routing from its HF config fields."""
    hf = config.hf
    arch = config.architecture
    if arch == "MixtralForCausalLM":
        return RoutingConfig(hf.num_local_experts, hf.num_experts_per_tok, renormalize=True)
    if arch.startswith("DeepseekV2"):
        grouped = getattr(hf, "topk_method", "greedy") == "group_limited_greedy"
        return RoutingConfig(hf.n_routed_experts, hf.num_experts_per_tok,
                             renormalize=bool(getattr(hf, "norm_topk_prob", False)),
                             num_groups=hf.n_group if grouped else 1,
                             topk_group=hf.topk_group if grouped else 1,
                             scaling_factor=float(hf.routed_scaling_factor))
    return RoutingConfig(hf.num_experts, hf.num_experts_per_tok,
                         renormalize=bool(getattr(hf, "norm_topk_prob", False)))


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
        self.router_fp32 = router_fp32
        self.experts = FusedMoE(self.routing.num_experts, hidden, expert_intermediate_size,
                                getattr(config.hf, "hidden_act", "silu"))
        self.shared_name = shared_name if shared_intermediate_size else None
        if shared_intermediate_size:
            setattr(self, shared_name, dense_mlp(config, shared_intermediate_size,
                                                 reduce_results=False))
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, quantize=False) \
            if shared_gate else None
        self.tp_size = get_tp_group().size
        self._takes_normed_row: dict[torch.dtype, bool] = {}

    def takes_normed_row(self, dtype: torch.dtype) -> bool:
        """Whether `forward_normed_row` runs for one decode row of `dtype`: routed experts
        only (no shared expert), one rank, a router with a one-row GEMV carrying the norm and
        experts the decode GEMVs take at one token (only with RADIXSERVE_MOE_ROW_FUSION=1)."""
        if dtype not in self._takes_normed_row:
            self._takes_normed_row[dtype] = (
                ROW_FUSION and self.shared_name is None and self.tp_size == 1
                and not self.router_fp32 and self.gate.bias is None
                and self.gate.fuses_rows(1, dtype, norm=True)
                and self.experts.gemv_configs(1, self.routing.top_k) is not None)
        return self._takes_normed_row[dtype]

    def forward_normed_row(self, stream: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """stream + forward(norm(stream)) for one decode row (`takes_normed_row`): the norm
        rides in the router's GEMV and the experts' gate|up GEMV, the residual add in their
        down GEMV; the layer's post-attention RMSNorm kernel is gone."""
        logits = self.gate.fused_row_product(stream, norm=norm)
        topk = select_experts(logits, self.routing)
        return self.experts.forward_normed_rows(stream, topk, norm.weight,
                                                norm.variance_epsilon)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.router_fp32:
            logits = torch.nn.functional.linear(hidden.float(), self.gate.weight.float())
        else:
            logits = self.gate(hidden)
        out = self.experts(hidden, select_experts(logits, self.routing))
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        if self.tp_size > 1:
            out = get_tp_group().all_reduce(out)
        return out
