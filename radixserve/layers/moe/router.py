"""Routing: router logits -> (top-k weights, top-k expert ids) per token, all on the device.

Kinds, as the model families define them:
  * softmax top-k (Mixtral, Qwen-MoE): softmax over all experts in float32, the k largest,
    renormalised to sum to 1 when `renormalize` (Mixtral always, Qwen when `norm_topk_prob`);
  * group-limited top-k (DeepSeek-V2): softmax, then only the experts of the `topk_group`
    groups (of `num_groups`) with the largest per-group maximum compete for the k places
    (Mistral-4: groups ranked by the sum of their two best scores, `group_score="top2_sum"`);
  * sigmoid top-k with a correction bias (DeepSeek-V3, R1, Kimi-K2: `noaux_tc`): scores are
    sigmoid(logits); the choice ranks score + bias (a per-expert load-balancing bias from the
    checkpoint), groups ranked by the sum of their two best biased scores; the weights are the
    chosen experts' unbiased scores, renormalised when `renormalize`;
  * the weights are multiplied by `scaling_factor` (DeepSeek's routed_scaling_factor).
No host sync and fixed shapes, so a decode step with routing can be captured in a CUDA graph.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

# RADIXSERVE_MOE_ROUTER_KERNEL=0: the torch routing on CUDA too (for A/B timing)
ROUTER_KERNEL = os.environ.get("RADIXSERVE_MOE_ROUTER_KERNEL", "1") != "0"


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
    # or "sigmoid" (DeepSeek-V3's noaux_tc, with a correction bias), or "sparsemixer"
    # (PhiMoE's two masked softmaxes, top-2 only)
    scoring: str = "softmax"
    group_score: str = "max"  # softmax groups ranked by their "max" or "top2_sum" (Mistral-4)
    jitter_eps: float = 0.0  # sparsemixer: the relative gap past which an expert is masked

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid", "sparsemixer"):
            raise ValueError(f"unknown MoE scoring function {self.scoring!r}")
        if self.scoring == "sparsemixer" and (self.top_k != 2 or self.num_groups != 1):
            raise ValueError("sparsemixer routing takes the top 2 experts, ungrouped")
        if self.group_score not in ("max", "top2_sum"):
            raise ValueError(f"unknown MoE group score {self.group_score!r}")
        if self.num_experts % self.num_groups:
            raise ValueError(f"{self.num_experts} experts do not split into "
                             f"{self.num_groups} groups")
        if self.topk_group * (self.num_experts // self.num_groups) < self.top_k:
            raise ValueError(f"top-{self.top_k} routing cannot fill from {self.topk_group} "
                             f"groups of {self.num_experts // self.num_groups} experts")


def select_experts(router_logits: torch.Tensor, config: RoutingConfig,
                   correction_bias: torch.Tensor | None = None) -> TopK:
    """router_logits: [T, E] -> the k experts of each token and their weights (float32).
    correction_bias [E] (sigmoid scoring only) shifts the choice, not the weights.
    On CUDA, ungrouped softmax routing and sigmoid routing are one Triton kernel each
    (layers/kernels/moe_router.py)."""
    grouped = config.num_groups > 1 and config.topk_group < config.num_groups
    if config.scoring == "sparsemixer":
        return _sparsemixer_top2(router_logits, config.jitter_eps)
    if config.scoring == "sigmoid":
        kernel = _router_kernel("sigmoid_grouped_topk", router_logits)
        if kernel is not None:
            return TopK(*kernel(router_logits, correction_bias, config.top_k, config.num_groups,
                                config.topk_group, config.renormalize, config.scaling_factor))
        return _sigmoid_topk(router_logits, config, correction_bias, grouped)
    kernel = None if grouped else _router_kernel("softmax_topk", router_logits)
    if kernel is not None:
        return TopK(*kernel(router_logits, config.top_k, config.renormalize,
                            config.scaling_factor))
    scores = torch.softmax(router_logits.float(), dim=-1)
    if grouped:
        per_group = _per_group(scores, config.num_groups)
        group_scores = per_group.amax(dim=-1) if config.group_score == "max" else \
            _top2_sum(per_group)
        scores = _keep_best_groups(per_group, group_scores, config.topk_group, 0.0)
    weights, ids = torch.topk(scores, config.top_k, dim=-1, sorted=False)
    return _weighted(weights, ids, config, eps=0.0)


def _router_kernel(name: str, router_logits: torch.Tensor) -> Any:
    """The Triton routing kernel `name` of layers/kernels/moe_router.py for CUDA logits, None
    on CPU, without Triton or with RADIXSERVE_MOE_ROUTER_KERNEL=0 (torch routes then)."""
    if not (router_logits.is_cuda and ROUTER_KERNEL):
        return None
    try:
        from radixserve.layers.kernels import moe_router
    except ImportError:
        return None
    return getattr(moe_router, name)


def _sigmoid_topk(router_logits: torch.Tensor, config: RoutingConfig,
                  correction_bias: torch.Tensor | None, grouped: bool) -> TopK:
    """DeepSeek-V3's noaux_tc routing (transformers' DeepseekV3TopkRouter, vLLM's
    grouped_topk with a correction bias)."""
    scores = torch.sigmoid(router_logits.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if grouped:
        per_group = _per_group(choice, config.num_groups)
        choice = _keep_best_groups(per_group, _top2_sum(per_group), config.topk_group,
                                   float("-inf"))
    ids = torch.topk(choice, config.top_k, dim=-1, sorted=False).indices
    return _weighted(scores.gather(1, ids), ids, config, eps=1e-20)


def _sparsemixer_top2(router_logits: torch.Tensor, jitter_eps: float) -> TopK:
    """PhiMoE's routing at inference (transformers' `sparsemixer`, eval mode): the best expert,
    weighted by its softmax over the experts whose score lies within 2 * jitter_eps of it
    (relative to max(|score|, best)); then the best of the rest, weighted the same way among
    the rest. In float32."""
    scores = router_logits.float()
    weights, ids = [], []
    masked = scores
    for _ in range(2):
        best, best_id = masked.max(dim=-1, keepdim=True)
        far = (best - scores) / scores.abs().clamp(min=best) > 2 * jitter_eps
        gates = torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1)
        weights.append(gates.gather(-1, best_id))
        ids.append(best_id)
        masked = masked.scatter(-1, best_id, float("-inf"))
    return TopK(torch.cat(weights, dim=-1), torch.cat(ids, dim=-1).to(torch.int32))


def _weighted(weights: torch.Tensor, ids: torch.Tensor, config: RoutingConfig,
              eps: float) -> TopK:
    """The chosen experts' weights renormalised (sum + eps) when asked, then scaled."""
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if config.scaling_factor != 1.0:
        weights = weights * config.scaling_factor
    return TopK(weights, ids.to(torch.int32))


def _top2_sum(per_group: torch.Tensor) -> torch.Tensor:
    """[T, G, S] -> [T, G]: each group's two best scores summed (its one, for groups of one)."""
    return per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)


def _per_group(scores: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[T, E] -> [T, num_groups, E / num_groups] (a view)."""
    num_tokens, num_experts = scores.shape
    return scores.view(num_tokens, num_groups, num_experts // num_groups)


def _keep_best_groups(per_group: torch.Tensor, group_scores: torch.Tensor, topk_group: int,
                      fill: float) -> torch.Tensor:
    """[T, G, S] -> [T, G * S] with `fill` in every group but the `topk_group` of the highest
    `group_scores` [T, G] (V2: a group's maximum, filled with 0; V3: its two best biased
    scores summed, filled with -inf)."""
    best = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return per_group.masked_fill(~keep.unsqueeze(-1), fill).flatten(1)
