"""Softmax top-k routing in one Triton launch: per token, softmax over the experts in float32,
the k largest (k rounds of max + first index of it, masked out after), optionally renormalised
to sum 1, times a scaling factor. Replaces ~6 small torch kernels per MoE layer (softmax, topk,
sum, div, mul, cast). Ties go to the lower expert id, as torch.topk's do in practice; the order
of the k choices does not matter to the experts' sum. DeepSeek-V3's sigmoid routing (a
correction bias, groups ranked by their two best biased scores) is a second kernel of the
same shape; V2's softmax group-limited routing stays in torch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# One warp per token's program up to this many experts: its k rounds of max and argmin then
# reduce within the warp, with no shared-memory round trips. On an H100, Qwen3-30B-A3B (128
# experts, top 8) decoded at batch 1 in 3.39-3.42 ms with one warp against 3.45-3.46 with four
# (session 40); two warps were in between.
ONE_WARP_MAX_EXPERTS = 128


@triton.jit
def _softmax_topk_kernel(Logits, Weights, Ids, num_experts, stride_l, scaling_factor,
                         TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                         RENORMALIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    logits = tl.load(Logits + token * stride_l + offs, mask=mask, other=float("-inf"))
    logits = logits.to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    probs = probs / tl.sum(probs, 0)
    probs = tl.where(mask, probs, -1.0)
    _store_top_k(probs, probs, offs, num_experts, Weights, Ids, token, scaling_factor, 0.0,
                 TOP_K, BLOCK_K, BLOCK_E, RENORMALIZE, WEIGHT_IS_CHOICE=True)


@triton.jit
def _store_top_k(choice, weights, offs, num_experts, Weights, Ids, token, scaling_factor, eps,
                 TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                 RENORMALIZE: tl.constexpr, WEIGHT_IS_CHOICE: tl.constexpr = False):
    """The k largest of `choice` (k rounds of max + its first index, masked out after), their
    `weights` entries (WEIGHT_IS_CHOICE: the choice values themselves, no gather), renormalised
    (sum + eps) when asked, times the scaling factor. NaN choices (a broken hidden state) rank
    last and every id stays below num_experts, so a bad request cannot send the experts'
    kernels past their weights."""
    choice = tl.where(choice == choice, choice, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, 0)
        index = tl.minimum(tl.min(tl.where(choice == best, offs, BLOCK_E), 0), num_experts - 1)
        if WEIGHT_IS_CHOICE:
            weight = best
        else:
            weight = tl.sum(tl.where(offs == index, weights, 0.0), 0)
        chosen = tl.where(offs_k == j, weight, chosen)
        chosen_ids = tl.where(offs_k == j, index.to(tl.int32), chosen_ids)
        choice = tl.where(offs == index, float("-inf"), choice)
    scale = scaling_factor
    if RENORMALIZE:
        scale = scaling_factor / (tl.sum(chosen, 0) + eps)
    k_mask = offs_k < TOP_K
    tl.store(Weights + token * TOP_K + offs_k, chosen * scale, mask=k_mask)
    tl.store(Ids + token * TOP_K + offs_k, chosen_ids, mask=k_mask)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int32), k <= E."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _softmax_topk_kernel[(num_tokens,)](
            logits, weights, ids, num_experts, logits.stride(0), float(scaling_factor),
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k),
            BLOCK_E=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
            num_warps=1 if num_experts <= ONE_WARP_MAX_EXPERTS else 4)
    return weights, ids


@triton.jit
def _sigmoid_grouped_topk_kernel(Logits, Bias, Weights, Ids, num_experts, group_size,
                                 stride_l, scaling_factor, TOP_K: tl.constexpr,
                                 BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                                 NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                                 BLOCK_G: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 RENORMALIZE: tl.constexpr):
    """DeepSeek-V3's noaux_tc routing for one token (see layers/moe/router.py): sigmoid
    scores, biased choice, groups ranked by the sum of their two best biased scores."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    logits = tl.load(Logits + token * stride_l + offs, mask=mask, other=0.0).to(tl.float32)
    scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores
    if HAS_BIAS:
        choice += tl.load(Bias + offs, mask=mask, other=0.0).to(tl.float32)
    choice = tl.where(mask, choice, float("-inf"))
    if NUM_GROUPS > 1:
        group_of = offs // group_size
        offs_g = tl.arange(0, BLOCK_G)
        group_scores = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            in_group = group_of == g
            first = tl.max(tl.where(in_group, choice, float("-inf")), 0)
            first_at = tl.min(tl.where(in_group & (choice == first), offs, BLOCK_E), 0)
            second = tl.max(tl.where(in_group & (offs != first_at), choice, float("-inf")), 0)
            second = tl.where(second == float("-inf"), 0.0, second)  # a group of one expert
            group_scores = tl.where(offs_g == g, first + second, group_scores)
        keep = offs < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_scores, 0)
            best_group = tl.min(tl.where(group_scores == best, offs_g, BLOCK_G), 0)
            keep = keep | (group_of == best_group)
            group_scores = tl.where(offs_g == best_group, float("-inf"), group_scores)
        choice = tl.where(keep, choice, float("-inf"))
    _store_top_k(choice, scores, offs, num_experts, Weights, Ids, token, scaling_factor, 1e-20,
                 TOP_K, BLOCK_K, BLOCK_E, RENORMALIZE)


def sigmoid_grouped_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor | None,
                         top_k: int, num_groups: int, topk_group: int, renormalize: bool,
                         scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi-K2 routing in one launch (the torch form takes ~13 kernels per MoE
    layer): router_logits [T, E], correction_bias [E] float32 or None -> (weights [T, k]
    float32, ids [T, k] int32). One group (or topk_group >= num_groups) skips the group
    stage."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    grouped = 1 < num_groups and topk_group < num_groups
    if num_tokens:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        bias = logits if correction_bias is None else correction_bias
        _sigmoid_grouped_topk_kernel[(num_tokens,)](
            logits, bias, weights, ids, num_experts, num_experts // num_groups,
            logits.stride(0), float(scaling_factor), TOP_K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(num_experts),
            NUM_GROUPS=num_groups if grouped else 1, TOPK_GROUP=topk_group if grouped else 1,
            BLOCK_G=triton.next_power_of_2(num_groups) if grouped else 1,
            HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize,
            num_warps=1 if num_experts <= ONE_WARP_MAX_EXPERTS else 4)
    return weights, ids
