"""Routed experts for a few decode tokens as two GEMV launches, without the alignment.

The fused-MoE path (fused_moe.py) sorts the (token, choice) pairs by expert, pads each expert's
run to a 16-row block and multiplies blocks on the tensor cores: four launches (alignment,
gate|up, SiLU-mul, down) and a torch sum over the k choices. At one to a few tokens each
expert's block holds one or two real rows, so the work is reading the chosen experts' weights,
and the launches around the two products are much of a layer's time (a Qwen3-30B-A3B decode
step at batch 1 ran at 0.36 of its weight-read limit on the H200, session 4).

Here each product is a GEMV over the chosen experts' rows, read straight through the pair's
expert id (no sorted order, no padding):
  gate|up: one program per (pair, block of BLOCK_N rows of each half): the pair's token row
           times the expert's gate and up rows, silu(gate) * up written per pair [T*k, I],
           rounded as the unfused kernels round them (gemv.store_row_epilogue);
  down:    one program per (token, block of BLOCK_N output rows): one loop over the k choices'
           K steps, each step's products scaled by the choice's routing weight (and the FP8
           row or group scale) into a float32 accumulator; at each choice's last step its row
           is rounded to the output's dtype and added to the token's float32 total, which is
           rounded once: the grouped path's rounding (each pair's weighted row rounded, the k
           rows summed in float32 by torch), so bf16 models decode as they did before this
           path. The k rows are summed in the kernel and [T, H] is written once.
A token choosing the same expert as another reads its rows again (through L2); the grouped
path reads each expert once, so it wins again past a few tokens: which path runs at T tokens
comes from a per-board table swept on the device (benchmarks/gpu_moe_gemv.py writes
moe_configs/gemv_{bf16|fp8}_E{e}_N{n}_K{k}.json: T -> the two kernels' configurations, or null
where the grouped path won), else the default rule below. RADIXSERVE_MOE_GEMV=0 turns the path off.

gpt-oss's experts: each expert's gate|up bias is added before the clamped SwiGLU (replacing
SiLU-mul), and its down bias, times the routing weight, to its choice's row.

FP8 experts: codes with per-row scales (applied once per row; in the down kernel with the
routing weight) or per K group (each BLOCK_K step inside one group scales its products). The
FP8 tables are swept with per-row scales (on the H100 they take up to 8 tokens); block-scaled
experts take the default rule, their steps cut to the group.
"""
from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixserve.layers.kernels import board_tables
from radixserve.layers.kernels.gemv import (GemvConfig, config_from_entry, first_weight_step,
                                            group_scaled, load_weight_tiles,
                                            spans_whole_groups, step_groups,
                                            store_row_epilogue, vec_sum)

ENABLED = os.environ.get("RADIXSERVE_MOE_GEMV", "1") != "0"
# Without a swept table (moe_gemv_configs): the GEMVs take one token (its k experts are
# distinct, nothing is read twice), and up to this many where each token picks 4+ experts (many
# small ones). On the H100 the GEMVs won at 4 tokens by 1.2x for Qwen3-30B-A3B (top 8 of 128)
# and DeepSeek-V2-Lite (top 6 of 64), and lost from 4 tokens for Mixtral (top 2 of 8).
DEFAULT_MAX_TOKENS = int(os.environ.get("RADIXSERVE_MOE_GEMV_MAX_TOKENS", "4"))
MAX_REREAD = 1.18  # default_takes: how many more expert reads than the grouped path's


class MoeGemvConfigs(NamedTuple):
    gate_up: GemvConfig  # block_n: rows of each half per program
    down: GemvConfig


@triton.jit
def _weight_tiles(w_ptrs, up_rows, n_mask, offs_k, k_left, GATED: tl.constexpr,
                  EVEN_K: tl.constexpr, VEC: tl.constexpr):
    """gemv.load_weight_tiles, with the columns past K masked where BLOCK_K does not divide
    K (k_left: the columns from this step's first on)."""
    if EVEN_K:
        w, w_up = load_weight_tiles(w_ptrs, up_rows, n_mask, GATED, VEC)
    else:
        if VEC > 1:
            mask = n_mask[:, None, None] & (offs_k < k_left)[None, :, :]
        else:
            mask = n_mask[:, None] & (offs_k < k_left)[None, :]
        w = tl.load(w_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
        w_up = w
        if GATED:
            w_up = tl.load(w_ptrs + up_rows, mask=mask, other=0.0,
                           eviction_policy="evict_first")
    return w, w_up


@triton.jit
def _x_tile(x_ptr, offs_k, k_left, EVEN_K: tl.constexpr):
    """The input row's columns of this step in float32 (zero past K)."""
    if EVEN_K:
        x = tl.load(x_ptr + offs_k)
    else:
        x = tl.load(x_ptr + offs_k, mask=offs_k < k_left, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _moe_gate_up_gemv_kernel(X, W, Scale, Ids, Bias, Y, I, K, stride_xm, stride_we, stride_wn,
                             stride_se, stride_sn, stride_be, stride_ym, alpha, limit,
                             TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr,
                             GROUPED: tl.constexpr, GROUP_K: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                             EVEN_K: tl.constexpr, STEP_GROUPS: tl.constexpr,
                             HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                             RELU2: tl.constexpr):
    """Y[pair, n] = silu(x[token] . W[e, n]) * (x[token] . W[e, I + n]), e = Ids[pair].
    RELU2 (ungated experts, W [E, I, K] the up projection alone): relu(x[token] . W[e, n])^2,
    the product rounded first as the grouped path stores it.
    STEP_GROUPS: the block scales' K groups one BLOCK_K step spans (gemv.group_scaled).
    gpt-oss: HAS_BIAS adds Bias[e] to gate and up; CLAMPED takes the clamped SwiGLU (alpha,
    limit) instead of SiLU-mul, gate and up rounded first as the grouped path stores them."""
    pair = tl.program_id(0)
    expert = tl.load(Ids + pair).to(tl.int64)
    x_row = X + (pair // TOP_K).to(tl.int64) * stride_xm
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k, w_ptrs, acc, no_squares = first_weight_step(
        W + expert * stride_we, offs_n.to(tl.int64) * stride_wn, BLOCK_N, BLOCK_K, VEC)
    acc_up = acc
    up_rows = I * stride_wn
    s_expert = Scale + expert * stride_se
    s_rows = s_expert + offs_n * stride_sn
    for k_start in range(0, K, BLOCK_K):
        w, w_up = _weight_tiles(w_ptrs, up_rows, n_mask, offs_k, K - k_start, not RELU2,
                                EVEN_K, VEC)
        x = _x_tile(x_row + k_start, offs_k, K - k_start, EVEN_K)
        prod = vec_sum(w.to(tl.float32) * x[None, :], VEC)
        if HAS_SCALE and GROUPED:
            prod = group_scaled(prod, s_expert, offs_n, n_mask, k_start, K, stride_sn, GROUP_K,
                                STEP_GROUPS)
        acc += prod
        if not RELU2:
            prod_up = vec_sum(w_up.to(tl.float32) * x[None, :], VEC)
            if HAS_SCALE and GROUPED:
                prod_up = group_scaled(prod_up, s_expert + I * stride_sn, offs_n, n_mask,
                                       k_start, K, stride_sn, GROUP_K, STEP_GROUPS)
            acc_up += prod_up
        w_ptrs += BLOCK_K
    gate = tl.sum(acc, axis=1)
    if HAS_SCALE and not GROUPED:
        gate = gate * tl.load(s_rows, mask=n_mask, other=0.0)
    y_row = Y + pair.to(tl.int64) * stride_ym
    if RELU2:
        up = gate.to(Y.dtype.element_ty).to(tl.float32)
        up = tl.where(up < 0.0, 0.0, up)  # torch.relu's: NaN stays NaN
        tl.store(y_row + offs_n, (up * up).to(Y.dtype.element_ty), mask=n_mask)
    else:
        up = tl.sum(acc_up, axis=1)
        if HAS_SCALE and not GROUPED:
            up = up * tl.load(s_rows + I * stride_sn, mask=n_mask, other=0.0)
        if HAS_BIAS:
            b_row = Bias + expert * stride_be
            gate += tl.load(b_row + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            up += tl.load(b_row + I + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if CLAMPED:
            gate = tl.minimum(gate.to(Y.dtype.element_ty).to(tl.float32), limit)
            up = tl.minimum(tl.maximum(up.to(Y.dtype.element_ty).to(tl.float32), -limit),
                            limit)
            glu = gate / (1.0 + tl.exp(-gate * alpha))
            tl.store(y_row + offs_n, ((up + 1.0) * glu).to(Y.dtype.element_ty), mask=n_mask)
        else:
            store_row_epilogue(gate, up, y_row, y_row, offs_n, n_mask, True, False)


@triton.jit
def _moe_down_gemv_kernel(A, W, Scale, Ids, Weights, Bias, Y, H, K, stride_am, stride_we,
                          stride_wn, stride_se, stride_sn, stride_be, stride_ym,
                          TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, GROUPED: tl.constexpr,
                          GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          VEC: tl.constexpr, EVEN_K: tl.constexpr, STEP_GROUPS: tl.constexpr,
                          HAS_BIAS: tl.constexpr):
    """Y[t, n] = sum over the token's k choices of weight * (A[pair] . W[e, n] (+ Bias[e, n])):
    one loop over every choice's K steps (each choice's row rounded as the grouped path
    rounds it)."""
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    rows = offs_n.to(tl.int64) * stride_wn
    offs_k, w_ptrs, acc, no_squares = first_weight_step(W, rows, BLOCK_N, BLOCK_K, VEC)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    steps = tl.cdiv(K, BLOCK_K)
    for step in range(0, TOP_K * steps):
        choice = step // steps
        k_start = (step - choice * steps) * BLOCK_K
        pair = token * TOP_K + choice
        expert = tl.load(Ids + pair).to(tl.int64)
        coef = tl.load(Weights + pair).to(tl.float32)
        w, w_again = _weight_tiles(w_ptrs + expert * stride_we + k_start, 0, n_mask, offs_k,
                                   K - k_start, False, EVEN_K, VEC)
        a = _x_tile(A + pair.to(tl.int64) * stride_am + k_start, offs_k, K - k_start, EVEN_K)
        prod = vec_sum(w.to(tl.float32) * a[None, :], VEC)
        if HAS_SCALE and GROUPED:
            acc += group_scaled(prod, Scale + expert * stride_se, offs_n, n_mask, k_start, K,
                                stride_sn, GROUP_K, STEP_GROUPS) * coef
        elif HAS_SCALE:
            coef = tl.load(Scale + expert * stride_se + offs_n * stride_sn, mask=n_mask,
                           other=0.0) * coef
            acc += prod * coef[:, None]
        else:
            acc += prod * coef
        if step - choice * steps == steps - 1:  # the choice's last step: its rounded row
            row = tl.sum(acc, axis=1)
            if HAS_BIAS:  # weight * (dot + bias), the dot already weighted
                row += coef_bias(Bias + expert * stride_be, offs_n, n_mask, Weights + pair)
            total += row.to(Y.dtype.element_ty).to(tl.float32)
            acc = tl.zeros_like(acc)
    tl.store(Y + token.to(tl.int64) * stride_ym + offs_n, total.to(Y.dtype.element_ty),
             mask=n_mask)


def fit_block_k(config: GemvConfig, k: int, group_k: int | None) -> GemvConfig | None:
    """The config with block_k over whole scale groups (gemv.spans_whole_groups) or inside
    one (halved until a group holds whole steps), or None where no step of at least 16
    columns (and one vec) fits. K itself needs no multiple: the last step masks its tail
    (EVEN_K)."""
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))
    while group_k is not None and block_k >= 16 and (block_k > group_k or group_k % block_k) \
            and not spans_whole_groups(config._replace(block_k=block_k), group_k):
        block_k //= 2
    if block_k < 16 or block_k < config.vec or k < 16:
        return None
    return config._replace(block_k=block_k)


def default_configs(fp8: bool) -> MoeGemvConfigs:
    """Without a swept entry: the dense GEMV's shape classes for gate|up and o/down-like rows
    (FP8 codes: twice the columns per step)."""
    scale = 2 if fp8 else 1
    return MoeGemvConfigs(GemvConfig(8, 256 * scale, 4, 3), GemvConfig(4, 256 * scale, 4, 3))


def table_name(kind: str, num_experts: int, n: int, k: int) -> str:
    """The swept table of the expert shape whose gate|up weight is [E, n, k] ("bf16" or "fp8"
    weights)."""
    return f"gemv_{kind}_E{num_experts}_N{n}_K{k}.json"


@functools.lru_cache(maxsize=None)
def _swept_table(kind: str, num_experts: int, n: int, k: int
                 ) -> tuple[tuple[int, dict | None], ...] | None:
    from radixserve.layers.kernels.fused_moe import CONFIG_DIR
    path = board_tables.read_path(CONFIG_DIR, table_name(kind, num_experts, n, k),
                                  board_tables.current_board())
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return tuple(sorted((int(tokens), entry) for tokens, entry in raw.items()))


def default_takes(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether the GEMVs take `num_tokens` tokens of `top_k` choices of `num_experts` without
    a swept table: one token, or up to DEFAULT_MAX_TOKENS where each picks 4+ experts and the
    GEMVs' reads (every pair's expert) exceed the grouped path's (each distinct expert, under
    uniform routing) by at most MAX_REREAD. At 4 tokens Qwen3-30B-A3B (top 8 of 128: 1.10x)
    and DeepSeek-V2-Lite (top 6 of 64: 1.15x) won with the GEMVs on the H100 by 1.2x;
    gpt-oss-20b (top 4 of 32: 1.21x) lost, 5.78 against 4.65 ms (session 42; dummy weights
    route every token alike, so the grouped path read fewer experts than real routing
    would: a table swept with real routing should decide it)."""
    if num_tokens == 1:
        return True
    if top_k < 4 or num_tokens > DEFAULT_MAX_TOKENS:
        return False
    distinct = num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)
    return num_tokens * top_k <= MAX_REREAD * distinct


def moe_gemv_configs(num_tokens: int, top_k: int, w13: torch.Tensor, w2: torch.Tensor,
                     group_k: int | None, ungated: bool = False) -> MoeGemvConfigs | None:
    """The two kernels' configurations where the GEMV path takes `num_tokens` tokens, else
    None. Swept table: the entry of the smallest swept count >= num_tokens (None past the
    largest, or where the grouped path won); no table (and ungated experts, whose tables
    were never swept): `default_takes`."""
    if not ENABLED or num_tokens == 0:
        return None
    num_experts, two_i, hidden = w13.shape
    fp8 = w13.dtype.itemsize == 1
    # the FP8 tables are swept with per-row scales; block scales (group_k) load a scale per
    # row and group of every step, a kernel the sweep never timed: the default rule
    table = None if group_k is not None or ungated else \
        _swept_table("fp8" if fp8 else "bf16", num_experts, two_i, hidden)
    if table is None:
        if not default_takes(num_tokens, top_k, w13.shape[0]):
            return None
        configs = default_configs(fp8)
    else:
        entry = next((entry for tokens, entry in table if tokens >= num_tokens), None)
        if entry is None:
            return None
        configs = MoeGemvConfigs(config_from_entry(entry["gate_up"]),
                                 config_from_entry(entry["down"]))
    gate_up = fit_block_k(configs.gate_up, hidden, group_k)
    down = fit_block_k(configs.down, w2.shape[2], group_k)
    if gate_up is None or down is None:
        return None
    return MoeGemvConfigs(gate_up, down)


@triton.jit
def coef_bias(B_row, offs_n, n_mask, Weight):
    """A choice's routing weight times its expert's bias over rows offs_n, float32."""
    bias = tl.load(B_row + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    return bias * tl.load(Weight).to(tl.float32)


def _scale_args(scale: torch.Tensor | None, fallback: torch.Tensor
                ) -> tuple[torch.Tensor, int, int, bool]:
    if scale is None:
        return fallback, 0, 0, False
    assert scale.stride(2) == 1
    return scale, scale.stride(0), scale.stride(1), scale.shape[2] > 1


def moe_gemv_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, configs: MoeGemvConfigs,
                     fp8_scales: tuple[torch.Tensor, torch.Tensor, int | None] | None = None,
                     biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                     swiglu: tuple[float, float] | None = None,
                     ungated: bool = False) -> torch.Tensor:
    """fused_moe.fused_experts' contract (hidden [T, H] -> [T, H]) through the two GEMVs
    (ungated: w13 [E, I, H] the up projection alone, ReLU squared after it)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w13.shape
    assert not (ungated and (biases is not None or swiglu is not None)), \
        "ungated experts take neither biases nor the clamped SwiGLU"
    inter = two_i if ungated else two_i // 2
    assert hidden.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    s13, s2, group_k = fp8_scales if fp8_scales is not None else (None, None, None)
    scale13, se13, sn13, grouped = _scale_args(s13, weights)
    act = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    up_cfg, down_cfg = configs
    b13, b2 = biases if biases is not None else (weights, weights)
    alpha, limit = swiglu if swiglu is not None else (1.0, 0.0)
    _moe_gate_up_gemv_kernel[(num_tokens * top_k, triton.cdiv(inter, up_cfg.block_n))](
        hidden, w13, scale13, ids, b13, act, inter, hidden_size, hidden.stride(0),
        w13.stride(0), w13.stride(1), se13, sn13, b13.stride(0) if biases else 0,
        act.stride(0), float(alpha), float(limit), TOP_K=top_k, HAS_SCALE=s13 is not None,
        GROUPED=grouped, GROUP_K=group_k or hidden_size, BLOCK_N=up_cfg.block_n,
        BLOCK_K=up_cfg.block_k, VEC=up_cfg.vec, EVEN_K=hidden_size % up_cfg.block_k == 0,
        STEP_GROUPS=step_groups(up_cfg, group_k, grouped), HAS_BIAS=biases is not None,
        CLAMPED=swiglu is not None, RELU2=ungated, num_warps=up_cfg.num_warps,
        num_stages=up_cfg.num_stages)
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    scale2, se2, sn2, grouped = _scale_args(s2, weights)
    _moe_down_gemv_kernel[(num_tokens, triton.cdiv(hidden_size, down_cfg.block_n))](
        act, w2, scale2, ids, weights, b2, out, hidden_size, inter, act.stride(0),
        w2.stride(0), w2.stride(1), se2, sn2, b2.stride(0) if biases else 0, out.stride(0),
        TOP_K=top_k, HAS_SCALE=s2 is not None,
        GROUPED=grouped, GROUP_K=group_k or inter, BLOCK_N=down_cfg.block_n,
        BLOCK_K=down_cfg.block_k, VEC=down_cfg.vec, EVEN_K=inter % down_cfg.block_k == 0,
        STEP_GROUPS=step_groups(down_cfg, group_k, grouped), HAS_BIAS=biases is not None,
        num_warps=down_cfg.num_warps, num_stages=down_cfg.num_stages)
    return out
