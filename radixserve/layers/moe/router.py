"""Routing: router logits -> (top-k weights, top-k expert ids) per token, all on the device.

Kinds, as the model families define them:
  * softmax top-k (Mixtral, Qwen-MoE): softmax over all experts in float32, the k largest,
    renormalised to sum to 1 when `renormalize` (Mixtral always, Qwen when `norm_topk_prob`);
  * group-limited top-k (DeepSeek-V2): softmax, then only the experts of the `topk_group`
    groups (of `num_groups`) with the largest per-group maximum compete for the k places;
  * the weights are multiplied by `scaling_factor` (DeepSeek's routed_scaling_factor).
No host sync and fixed shapes, so a decode step with routing can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class TopK(NamedTuple):
    weights: torch.Tensor  # [T, k] float32
    ids: torch.Tensor  # [T, k] int32 expert ids


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    renormalize: bool = False
    num_groups: int = 1  # group-limited routing when topk_group < num_groups
    topk_group: int = 1
    scaling_factor: float = 1.0


def select_experts(router_logits: torch.Tensor, config: RoutingConfig) -> TopK:
    """router_logits: [T, E] -> the k experts of each token and their weights (float32).
    On CUDA, ungrouped routing is one Triton kernel (layers/kernels/moe_router.py)."""
    grouped = config.num_groups > 1 and config.topk_group < config.num_groups
    if router_logits.is_cuda and not grouped:
        try:
            from radixserve.layers.kernels.moe_router import softmax_topk
        except ImportError:
            pass
        else:
            return TopK(*softmax_topk(router_logits, config.top_k, config.renormalize,
                                      config.scaling_factor))
    scores = torch.softmax(router_logits.float(), dim=-1)
    if grouped:
        scores = _mask_to_best_groups(scores, config.num_groups, config.topk_group)
    weights, ids = torch.topk(scores, config.top_k, dim=-1, sorted=False)
    if config.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if config.scaling_factor != 1.0:
        weights = weights * config.scaling_factor
    return TopK(weights, ids.to(torch.int32))


def _mask_to_best_groups(scores: torch.Tensor, num_groups: int, topk_group: int
                         ) -> torch.Tensor:
    """Zero the scores of experts outside the `topk_group` groups with the highest maximum."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    best_groups = torch.topk(grouped.amax(dim=-1), topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, best_groups, True)
    return (grouped * keep.unsqueeze(-1)).view(num_tokens, num_experts)
