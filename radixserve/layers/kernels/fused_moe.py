"""Fused MoE on the GPU: tokens sorted by expert, then one grouped GEMM launch per projection.

  1. moe_align_block_size: the (token, choice) pairs sorted by expert, each expert's run padded
     to a multiple of BLOCK_M (padding rows hold the sentinel T*k), and the expert of every
     BLOCK_M block. Plain torch ops with static shapes (no host sync, CUDA-graph capturable);
     up to ALIGN_KERNEL_MAX_PAIRS pairs (decode) one Triton launch instead (moe_align.py).
  2. gate|up: one launch over (blocks of pairs) x (blocks of 2I): block b multiplies its pairs'
     hidden rows by expert_ids[b]'s w13 -> [T*k, 2I].
  3. SiLU(gate) * up (the layers' Triton kernel) -> [T*k, I].
  4. down: the same kernel over w2 with each pair's routing weight applied to its row
     -> [T*k, H]; the k rows of a token are then summed.
Blocks past the padded total exit at once; the grid holds the most blocks the padded runs can
fill, cdiv(T*k, BLOCK_M) + min(E, T*k), so decode (few pairs, many experts) launches few.

A few decode tokens take moe_gemv.py's two launches instead (its table or default rule).

Block sizes come from `moe_kernel_config`: a JSON table tuned on the H200 for the expert shape
(moe_configs/E{experts}_N{n}_K{k}.json, batch size -> config, bf16 on the H200, written by
benchmarks/gpu_moe.py --sweep),
else a heuristic: small blocks of pairs for decode (the weights' read bounds the time), large
ones for prefill.
"""
from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING
from pathlib import Path

import torch
import triton
import triton.language as tl

from radixserve.layers.activation import clamped_swiglu, relu_squared
from radixserve.layers.kernels import board_tables
from radixserve.layers.kernels.int4_gemm import _unpacked_tile
from radixserve.layers.kernels.moe_align import (ALIGN_KERNEL_MAX_PAIRS,
                                                 moe_align_block_size_triton)
from radixserve.layers.kernels.moe_gemv import moe_gemv_configs, moe_gemv_experts
from radixserve.layers.kernels.silu_and_mul import silu_and_mul

if TYPE_CHECKING:
    from radixserve.layers.moe.int4_experts import Int4ExpertStacks

CONFIG_DIR = Path(__file__).parent / "moe_configs"  # per board: kernels/board_tables.py


@triton.jit
def _fused_moe_kernel(
    A, B, C, Topk_weights, Sorted_token_ids, Expert_ids, Num_tokens_post_padded, B_scale,
    Bias, Zeros, N, K, num_valid_tokens,
    stride_am, stride_be, stride_bn, stride_cm, stride_se, stride_sn, stride_bias_e,
    stride_ze, num_groups,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TOP_K: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_W: tl.constexpr, GROUPED: tl.constexpr,
    GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, INT4_W: tl.constexpr = False,
    HAS_ZEROS: tl.constexpr = False,
):
    """HAS_BIAS: each expert's bias row [N] is added before the routing weight multiplies.
    INT4_W: B is int4 codes in int32 words [E, N, K / 8] with scales (and zero points, where
    HAS_ZEROS) [E, N, num_groups] over GROUP_K features, unpacked per tile in registers
    (int4_gemm._unpacked_tile); K is then a multiple of BLOCK_K, which divides GROUP_K."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(tl.num_programs(0), tl.cdiv(N, BLOCK_N))
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M blocks of pairs share each weight tile while it is in L2
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size

    if pid_m * BLOCK_M >= tl.load(Num_tokens_post_padded):
        return
    expert = tl.load(Expert_ids + pid_m).to(tl.int64)
    offs_pair = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(Sorted_token_ids + offs_pair)
    pair_mask = pairs < num_valid_tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_bn = offs_n % N  # wrapped: loads stay in bounds, the store masks
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + (pairs // TOP_K).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + expert * stride_be + offs_bn[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    s_ptrs = B_scale + expert * stride_se + offs_bn * stride_sn
    for k_start in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k_start
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        if INT4_W:
            b = _unpacked_tile(B + expert * stride_be, B_scale + expert * stride_se,
                               Zeros + expert * stride_ze, offs_bn, offs_bn < N, k_start,
                               stride_bn, num_groups, GROUP_K, HAS_ZEROS, BLOCK_K,
                               BLOCK_N).to(a.dtype)
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if FP8_W:  # FP8 codes, exact in a's dtype; scales per row (and per K group)
            b = b.to(a.dtype)
        if GROUPED:
            part = tl.dot(a, b, input_precision=DOT_PRECISION)
            acc += part * tl.load(s_ptrs + k_start // GROUP_K)[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if FP8_W and not GROUPED:
        acc = acc * tl.load(s_ptrs)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + expert * stride_bias_e + offs_bn).to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        weights = tl.load(Topk_weights + pairs, mask=pair_mask, other=0.0)
        acc = acc * weights[:, None]
    c_ptrs = C + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=pair_mask[:, None] & (offs_n[None, :] < N))


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids [max_padded] int32, expert of each block [max_blocks] int32, padded
    total [1] int32). Pair p = token * k + choice; padding rows hold T*k."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    max_padded = num_pairs + num_experts * (block_m - 1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - \
        (torch.cumsum(counts, 0) - counts)[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank_in_expert
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32)


@functools.lru_cache(maxsize=None)
def _tuned_table(num_experts: int, n: int, k: int) -> dict[int, dict[str, int]] | None:
    path = board_tables.read_path(CONFIG_DIR, f"E{num_experts}_N{n}_K{k}.json",
                                  board_tables.current_board())
    if not path.exists():
        return None
    return {int(m): cfg for m, cfg in json.loads(path.read_text()).items()}


def moe_kernel_config(num_tokens: int, num_experts: int, n: int, k: int) -> dict[str, int]:
    """Block sizes for a projection of `n` outputs over `k` inputs at this many tokens."""
    table = _tuned_table(num_experts, n, k)
    if table:
        nearest = min(table, key=lambda m: abs(m - num_tokens))
        return dict(table[nearest])
    if num_tokens <= 32:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if num_tokens <= 256:
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def invoke_moe_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                    topk_weights: torch.Tensor, aligned: tuple[torch.Tensor, ...],
                    top_k: int, mul_routed_weight: bool, config: dict[str, int],
                    w_scale: torch.Tensor | None = None, group_k: int | None = None,
                    bias: torch.Tensor | None = None,
                    int4: tuple[torch.Tensor, torch.Tensor | None, int] | None = None) -> None:
    """out[pair] = a[pair // top_k] @ w[expert(pair)].T (+ bias[expert(pair)]) (x the pair's
    weight). FP8 w: codes with w_scale [E, N, G] (G = 1, or one per group_k columns of K).
    int4 = (scales [E, N, G], zeros [E, N, G] or None, group_k): w is int4 words [E, N, K / 8]."""
    sorted_ids, expert_ids, num_post_padded = aligned
    n, k = w.shape[1], w.shape[2] * (8 if int4 is not None else 1)
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    block_m, num_pairs, num_experts = config["BLOCK_M"], topk_weights.numel(), w.shape[0]
    # padded runs fill at most cdiv(pairs, BLOCK_M) blocks plus one partial block per expert
    # used: a grid that large (not max_padded / BLOCK_M) leaves few programs to exit at once
    blocks_m = min(triton.cdiv(sorted_ids.numel(), block_m),
                   triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs))
    grid = (blocks_m * triton.cdiv(n, config["BLOCK_N"]),)
    grouped = w_scale is not None and w_scale.shape[2] > 1
    block_k = min(config["BLOCK_K"], group_k) if grouped and group_k else config["BLOCK_K"]
    zeros = None
    if int4 is not None:
        w_scale, zeros, group_k = int4
        block_k = max(b for b in (128, 64, 32, 16)
                      if b <= max(config["BLOCK_K"], 16) and k % b == 0 and group_k % b == 0)
    scale = w_scale if w_scale is not None else topk_weights
    _fused_moe_kernel[grid](
        a, w, out, topk_weights, sorted_ids, expert_ids, num_post_padded, scale,
        bias if bias is not None else topk_weights, zeros if zeros is not None else scale,
        n, k, topk_weights.numel(), a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        scale.stride(0) if w_scale is not None else 0,
        scale.stride(1) if w_scale is not None else 0,
        bias.stride(0) if bias is not None else 0,
        zeros.stride(0) if zeros is not None else 0,
        w_scale.shape[2] if int4 is not None else 1,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=block_k,
        GROUP_M=config["GROUP_M"], TOP_K=top_k, MUL_ROUTED_WEIGHT=mul_routed_weight,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        FP8_W=w_scale is not None and int4 is None, GROUPED=grouped and int4 is None,
        GROUP_K=group_k or k, HAS_BIAS=bias is not None, INT4_W=int4 is not None,
        HAS_ZEROS=zeros is not None, num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  fp8_scales: tuple[torch.Tensor, torch.Tensor, int | None] | None = None,
                  biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                  swiglu: tuple[float, float] | None = None,
                  activation: str | None = None,
                  int4: "Int4ExpertStacks | None" = None) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [T, k] -> [T, H]: sum over each
    token's k experts of weight * down(silu(gate) * up). FP8 experts: fp8_scales = (w13 scales
    [E, 2I, G1], w2 scales [E, H, G2], block or None). gpt-oss: biases (gate|up [E, 2I],
    down [E, H]) added in the products' epilogues, and swiglu = (alpha, limit) of the clamped
    SwiGLU (layers/activation.clamped_swiglu) instead of SiLU-mul. Ungated experts
    (Nemotron-H, activation "relu2"): w13 [E, I, H] the up projection alone and ReLU squared
    between the products. int4 experts: w13 / w2 int4 words [E, 2I, H / 8] / [E, H, I / 8],
    `int4` their scales, zero points and groups (moe/int4_experts.py)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w13.shape
    hidden_size = hidden.shape[1]  # int4 stacks hold K / 8 words
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    if activation not in (None, "relu2"):
        raise ValueError(f"fused experts' activation {activation!r} is not supported")
    ungated = activation == "relu2"
    gemv = None if int4 is not None else moe_gemv_configs(
        num_tokens, top_k, w13, w2, fp8_scales[2] if fp8_scales is not None else None, ungated)
    if gemv is not None:  # a few decode tokens: two GEMVs, no alignment (moe_gemv.py)
        return moe_gemv_experts(hidden, w13, w2, topk_weights, topk_ids, gemv, fp8_scales,
                                biases, swiglu, ungated)
    config1 = moe_kernel_config(num_tokens, num_experts, two_i, hidden_size)
    intermediate = w2.shape[2] * (8 if int4 is not None else 1)
    config2 = moe_kernel_config(num_tokens, num_experts, hidden_size, intermediate)
    weights = topk_weights.reshape(-1).to(torch.float32)
    align = moe_align_block_size_triton if num_tokens * top_k <= ALIGN_KERNEL_MAX_PAIRS \
        else moe_align_block_size
    aligned = align(topk_ids, config1["BLOCK_M"], num_experts)
    gate_up = torch.empty(num_tokens * top_k, two_i, dtype=hidden.dtype, device=hidden.device)
    s13, s2, block = fp8_scales if fp8_scales is not None else (None, None, None)
    b13, b2 = biases if biases is not None else (None, None)
    int4_13 = (int4.w13_scales, int4.w13_zeros, int4.w13_group_k) if int4 is not None else None
    int4_2 = (int4.w2_scales, int4.w2_zeros, int4.w2_group_k) if int4 is not None else None
    invoke_moe_gemm(hidden, w13, gate_up, weights, aligned, top_k, False, config1, s13, block,
                    b13, int4_13)
    if ungated:
        act = relu_squared(gate_up)
    else:
        act = silu_and_mul(gate_up) if swiglu is None else clamped_swiglu(gate_up, *swiglu)
    if config2["BLOCK_M"] != config1["BLOCK_M"]:
        aligned = align(topk_ids, config2["BLOCK_M"], num_experts)
    down = torch.empty(num_tokens * top_k, hidden_size, dtype=hidden.dtype,
                       device=hidden.device)
    invoke_moe_gemm(act, w2, down, weights, aligned, 1, True, config2, s2, block, b2, int4_2)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1)


def fused_experts_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                            swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """Per (token, choice) in float32: weight * (w2[e] @ act(w13[e] x + b13[e]) + b2[e]), act
    SiLU(gate) * up, or the clamped SwiGLU of (alpha, limit)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    half = w13.shape[1] // 2
    for t in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e].float() @ hidden[t].float()
            if biases is not None:
                gate_up = gate_up + biases[0][e].float()
            if swiglu is None:
                act = torch.nn.functional.silu(gate_up[:half]) * gate_up[half:]
            else:
                act = clamped_swiglu(gate_up, *swiglu)
            down = w2[e].float() @ act
            if biases is not None:
                down = down + biases[1][e].float()
            out[t] += float(topk_weights[t, j]) * down
    return out
