"""Matrix-vector product for one-token decode: y[N] = W[N, K] @ x[K] (+ b), in Triton.

A batch-1 decode step is a stream of GEMVs over 15 GB of weights; its speed is the rate at which
weight rows are read. On an H200 (Llama-3.1-8B shapes, bf16, benchmarks/gpu_tune.py) cuBLAS
reaches 2.5-4.2 TB/s depending on the shape (split-K plus a reduction kernel for the narrow ones),
this kernel 3.3-4.5 TB/s: 3.69 ms instead of 4.00-4.19 ms for one step's GEMMs (the
configurations below are the best of a sweep per shape class).

Each program owns BLOCK_N output rows and walks K in BLOCK_K steps, accumulating elementwise
products in fp32 registers ([BLOCK_N, BLOCK_K], or [BLOCK_N, BLOCK_K / vec] when each thread's
vec contiguous products are summed first: GemvConfig.vec) and reducing once at the end; weights
are loaded with evict_first since each byte is read exactly once per step. K must be a multiple
of BLOCK_K (`gemv_config` picks one or returns None, and callers fall back to cuBLAS).

The same kernel reads FP8 weight codes (HAS_SCALE): per-row scales applied once at the end, or
(GROUPED) per K group of GROUP_K columns as each BLOCK_K step is added: a step inside one
group takes one scale per row, a step over several whole groups one per row and group.
Swept configurations per shape (benchmarks/gpu_gemm_tune.py) come from `gemm_tables`.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue
from radixserve.layers.kernels.gemm_tables import tuned_entry
from radixserve.layers.kernels.gemv_rope import (RopeStore, check_rope_store, rope_kernel_args,
                                                 rope_launch_options, rope_pair_rows,
                                                 rope_store_epilogue)

# the first weight tile loaded before the PDL wait (_gemv_kernel): H200 batch-1 decode, Llama-3.1-8B
# shapes, bf16 4.20 -> 4.14 ms, FP8 2.81 -> 2.79 ms; RADIXSERVE_GEMV_EARLY_WEIGHTS=0 loads it after
EARLY_WEIGHTS = os.environ.get("RADIXSERVE_GEMV_EARLY_WEIGHTS", "1") != "0"
# an FP8 step over several 128-column scale groups of a block-scaled checkpoint (DeepSeek-V3,
# Qwen3-FP8) instead of one group per step; RADIXSERVE_FP8_GEMV_WIDE_GROUPS=0 caps the step
WIDE_GROUP_STEPS = os.environ.get("RADIXSERVE_FP8_GEMV_WIDE_GROUPS", "1") != "0"



class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # vec > 1: each BLOCK_K step's tile is [block_n, block_k / vec, vec] and its products are
    # summed over the last axis (vec contiguous weights of one thread) before they are
    # accumulated, so the float32 accumulator holds block_n x block_k / vec values instead of
    # block_n x block_k: fewer registers, more programs per SM (FP8 codes, 16 to a 16-byte load)
    vec: int = 1


@triton.jit
def load_weight_tiles(w_ptrs, up_rows, n_mask, GATED: tl.constexpr, VEC: tl.constexpr = 1):
    """One BLOCK_K step's weight tile, and (GATED) the up half's tile N rows down (else the
    same tile again, unused); VEC > 1: the tile is [BLOCK_N, BLOCK_K / VEC, VEC]."""
    if VEC > 1:
        mask = n_mask[:, None, None]
    else:
        mask = n_mask[:, None]
    w = tl.load(w_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    w_up = w
    if GATED:
        w_up = tl.load(w_ptrs + up_rows, mask=mask, other=0.0, eviction_policy="evict_first")
    return w, w_up


@triton.jit
def first_weight_step(W, rows, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      VEC: tl.constexpr):
    """A K step's column offsets, the first step's weight pointers (rows: each output row's
    offset into W, int64) and a zeroed float32 accumulator and sum of squares, laid out for
    VEC: > 1, [BLOCK_K / VEC, VEC] per row, each thread's VEC contiguous columns summed
    before they are accumulated."""
    if VEC > 1:
        offs_k = tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
        w_ptrs = W + rows[:, None, None] + offs_k[None, :, :]
        acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
        squares = tl.zeros([BLOCK_K // VEC, VEC], dtype=tl.float32)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = W + rows[:, None] + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    return offs_k, w_ptrs, acc, squares


@triton.jit
def squares_total(squares, VEC: tl.constexpr):
    """A row's sum of squares (first_weight_step's layout) as one number."""
    if VEC > 1:
        total = tl.sum(tl.sum(squares, axis=1), axis=0)
    else:
        total = tl.sum(squares, axis=0)
    return total


@triton.jit
def vec_sum(prod, VEC: tl.constexpr):
    """A step's products as accumulated: VEC > 1 sums each thread's VEC contiguous ones."""
    if VEC > 1:
        summed = tl.sum(prod, axis=2)
    else:
        summed = prod
    return summed


@triton.jit
def group_scaled(prod, Scale, offs_n, n_mask, k_start, K, stride_sn, GROUP_K: tl.constexpr,
                 STEP_GROUPS: tl.constexpr):
    """A step's products [BLOCK_N, C] (C columns of BLOCK_K, or of BLOCK_K / VEC sums) times
    their K groups' scales: one per row when the step lies in one group (STEP_GROUPS 1), else
    the step's STEP_GROUPS = BLOCK_K / GROUP_K groups side by side (block-scaled checkpoints'
    128-column groups would otherwise cap an FP8 step at 128 bytes a row). Groups past K (a
    last step's masked tail) take scale 0."""
    if STEP_GROUPS == 1:
        scaled = prod * tl.load(Scale + offs_n * stride_sn + k_start // GROUP_K, mask=n_mask,
                                other=0.0)[:, None]
    else:
        rows: tl.constexpr = prod.shape[0]
        cols: tl.constexpr = prod.shape[1]
        groups = tl.arange(0, STEP_GROUPS)
        s = tl.load(Scale + offs_n[:, None] * stride_sn + k_start // GROUP_K + groups[None, :],
                    mask=n_mask[:, None] & (k_start + groups * GROUP_K < K)[None, :], other=0.0)
        scaled = tl.reshape(tl.reshape(prod, (rows, STEP_GROUPS, cols // STEP_GROUPS))
                            * s[:, :, None], (rows, cols))
    return scaled


@triton.jit
def _gemv_step(acc, acc_up, squares, w, w_up, X, NormW, Scale, offs_n, n_mask, offs_k, k_start,
               N, K, stride_sn, NORM: tl.constexpr, GATED: tl.constexpr, HAS_SCALE: tl.constexpr,
               GROUPED: tl.constexpr, GROUP_K: tl.constexpr, VEC: tl.constexpr,
               STEP_GROUPS: tl.constexpr):
    """One BLOCK_K step: the weight tile(s) w (and w_up) times x[k_start:], accumulated
    (offs_k: [BLOCK_K], or [BLOCK_K / VEC, VEC] when VEC > 1)."""
    x = tl.load(X + k_start + offs_k).to(tl.float32)
    if NORM:  # RMSNorm's weight now, its 1/rms once the row's squares are summed
        squares += x * x
        x = x * tl.load(NormW + k_start + offs_k).to(tl.float32)
    prod = vec_sum(w.to(tl.float32) * x[None, :], VEC)
    if GATED:
        prod_up = vec_sum(w_up.to(tl.float32) * x[None, :], VEC)
    if HAS_SCALE and GROUPED:
        prod = group_scaled(prod, Scale, offs_n, n_mask, k_start, K, stride_sn, GROUP_K,
                            STEP_GROUPS)
        if GATED:
            prod_up = group_scaled(prod_up, Scale + N * stride_sn, offs_n, n_mask, k_start, K,
                                   stride_sn, GROUP_K, STEP_GROUPS)
    acc += prod
    if GATED:
        acc_up += prod_up
    return acc, acc_up, squares


@triton.jit
def _gemv_kernel(X, W, Scale, B, Y, NormW, Residual, N, K, stride_wn, stride_sn, eps,
                 Positions, Cos, Sin, KCache, VCache, Loc, stride_cos, stride_sin,
                 stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h, num_q_heads,
                 num_kv_heads, k_scale_inv, v_scale_inv,
                 HAS_SCALE: tl.constexpr, GROUPED: tl.constexpr, GROUP_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                 RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EARLY_W: tl.constexpr, USE_PDL: tl.constexpr, ROPE: tl.constexpr,
                 HALF: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
                 VEC: tl.constexpr, STEP_GROUPS: tl.constexpr):
    """N: the output rows; GATED reads gate rows [0, N) and up rows [N, 2N) of W.
    STEP_GROUPS: the K groups of scales one BLOCK_K step spans (1: it lies inside one).

    ROPE (a q|k|v product, kernels/gemv_rope.py): each program owns rope pairs of one head
    instead of consecutive rows, and its epilogue rotates q and k and stores K/V into the pool
    (Positions .. v_scale_inv; HALF = head_dim / 2).

    EARLY_W: the first weight tile is loaded before the PDL wait, so a program that starts
    while its predecessor still runs already has HBM busy with its first tile. Safe because no
    kernel of a forward pass writes weights, whichever kernels are still running (the one
    right before, and the one before it where that one launched this early:
    triton_pdl.pdl_launch_then_wait); x, the norm's input and the residual are read after the
    wait."""
    pid = tl.program_id(0)
    if ROPE:
        offs_n = rope_pair_rows(pid, BLOCK_N, HALF)
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k, w_ptrs, acc, squares = first_weight_step(
        W, offs_n.to(tl.int64) * stride_wn, BLOCK_N, BLOCK_K, VEC)
    acc_up = acc
    up_rows = N * stride_wn  # GATED: the up half starts N rows down
    if EARLY_W:
        w_first, w_first_up = load_weight_tiles(w_ptrs, up_rows, n_mask, GATED, VEC)
    pdl_prologue(USE_PDL)
    if ROPE:  # the position now, its cos and sin in the epilogue (nothing waits on it sooner)
        pos = tl.load(Positions).to(tl.int64)
    k_begin = 0
    if EARLY_W:
        acc, acc_up, squares = _gemv_step(
            acc, acc_up, squares, w_first, w_first_up, X, NormW, Scale, offs_n, n_mask, offs_k,
            0, N, K, stride_sn, NORM, GATED, HAS_SCALE, GROUPED, GROUP_K, VEC, STEP_GROUPS)
        w_ptrs += BLOCK_K
        k_begin = BLOCK_K
    for k_start in range(k_begin, K, BLOCK_K):
        w, w_up = load_weight_tiles(w_ptrs, up_rows, n_mask, GATED, VEC)
        acc, acc_up, squares = _gemv_step(
            acc, acc_up, squares, w, w_up, X, NormW, Scale, offs_n, n_mask, offs_k, k_start, N,
            K, stride_sn, NORM, GATED, HAS_SCALE, GROUPED, GROUP_K, VEC, STEP_GROUPS)
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if NORM:
        inv_rms = tl.rsqrt(squares_total(squares, VEC) / K + eps)
        y = y * inv_rms
    y = _scale_and_bias(y, offs_n, n_mask, 0, Scale, B, stride_sn, HAS_SCALE, GROUPED,
                        HAS_BIAS)
    if GATED:  # silu(gate) * up, each rounded as the unfused layers round them
        up = tl.sum(acc_up, axis=1)
        if NORM:
            up = up * inv_rms
        up = _scale_and_bias(up, offs_n, n_mask, N, Scale, B, stride_sn, HAS_SCALE, GROUPED,
                             HAS_BIAS)
    else:
        up = y  # unused
    if ROPE:
        rope_store_epilogue(y, offs_n, Y, pos, Cos, Sin, Loc, stride_cos, stride_sin, KCache,
                            VCache, stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h,
                            num_q_heads, num_kv_heads, k_scale_inv, v_scale_inv, BLOCK_N, HALF,
                            QUANT, FP8_MAX)
    else:
        store_row_epilogue(y, up, Y, Residual, offs_n, n_mask, GATED, RESIDUAL)


@triton.jit
def store_row_epilogue(y, up, Y, Residual, offs_n, n_mask, GATED: tl.constexpr,
                       RESIDUAL: tl.constexpr):
    """One output row's end (float32 sums y, and up's when GATED): silu(gate) * up, each
    rounded as the unfused layers round them; the residual stream's add, rounded as torch's add
    of two rounded tensors; stored at Y in its dtype (Residual: the row's residual)."""
    if GATED:
        gate = y.to(Y.dtype.element_ty).to(tl.float32)
        up = up.to(Y.dtype.element_ty).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32) * up
    if RESIDUAL:
        r = tl.load(Residual + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        y = y.to(Y.dtype.element_ty).to(tl.float32) + r
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=n_mask)


@triton.jit
def _scale_and_bias(y, offs_n, n_mask, row_offset, Scale, B, stride_sn,
                    HAS_SCALE: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Per-row scales and bias of rows offs_n + row_offset."""
    if HAS_SCALE and not GROUPED:
        y = y * tl.load(Scale + (offs_n + row_offset) * stride_sn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + offs_n + row_offset, mask=n_mask, other=0.0).to(tl.float32)
    return y


def gemv_config(n: int, k: int) -> GemvConfig | None:
    """The measured best shape class (H200, bf16) for an [n, k] weight; None if k fits no
    block size."""
    if k >= 8192:  # down_proj: few long rows
        block_n, block_k, warps, stages = 2, 1024, 8, 2
    elif n <= 4096:  # o_proj
        block_n, block_k, warps, stages = 4, 512, 8, 4
    elif n <= 8192:  # qkv_proj
        block_n, block_k, warps, stages = 8, 512, 4, 3
    else:  # gate_up_proj, lm_head
        block_n, block_k, warps, stages = 16, 256, 4, 3
    while block_k >= 64 and k % block_k:
        block_k //= 2
    if block_k < 64:
        return None
    return GemvConfig(block_n, block_k, warps, stages)


def config_from_entry(entry: dict) -> GemvConfig:
    """A table entry's GEMV configuration, one row or (fused_rows.py) 2-8 (entries written
    before `vec` existed have 1)."""
    return GemvConfig(entry["block_n"], entry["block_k"], entry["num_warps"],
                      entry["num_stages"], entry.get("vec", 1))


def tuned_gemv_config(kind: str, n: int, k: int) -> GemvConfig | None:
    """The swept GEMV configuration for a [n, k] weight of this kind ("bf16" or "fp8"), else
    the shape-class default."""
    entry = tuned_entry(kind, n, k, 1)
    if entry is not None and "block_n" in entry and k % entry["block_k"] == 0:
        return config_from_entry(entry)
    if kind == "bf16":
        return gemv_config(n, k)
    # FP8 rows are half as many bytes as bf16 ones: twice the columns per step (where K
    # has them; a narrow K takes the bf16 step)
    half = gemv_config(n, k // 2)
    return gemv_config(n, k) if half is None else half._replace(block_k=half.block_k * 2)


class RowFusion(NamedTuple):
    """What a one-row product fuses around the GEMV (all off: the plain product).

    norm_weight/eps: x is the residual stream s and the product takes RMSNorm(s) as its input
    (the norm's weight applied per column, 1/rms(s) once per output row, all in float32);
    gated: the weight stacks gate and up rows ([2I, K]) and the output is silu(gate) * up [I];
    residual: the output is residual + product (the residual stream's next value).
    """
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    gated: bool = False
    residual: torch.Tensor | None = None

    @property
    def variant(self) -> str:
        """The name of this fusion's swept configuration in a table entry ("" none)."""
        return fusion_variant(self.norm_weight is not None, self.gated,
                              self.residual is not None)


def fusion_variant(norm: bool, gated: bool, residual: bool) -> str:
    """A fusion's name in the tables: "norm", "norm+gated", "residual", ... ("" none)."""
    return "+".join(name for name, on in (("norm", norm), ("gated", gated),
                                           ("residual", residual)) if on)


NO_FUSION = RowFusion()


def fused_config(config: GemvConfig, fusion: RowFusion) -> GemvConfig:
    """A gated product loads two weight tiles per step: half the rows of each per program."""
    if fusion.gated and config.block_n > 1:
        return config._replace(block_n=config.block_n // 2)
    return config


def row_config(kind: str, n: int, k: int, fusion: RowFusion) -> GemvConfig | None:
    """The configuration of a one-row product of this kind with `fusion`: the variant's swept
    entry (benchmarks/gpu_row_fusion.py --write; block_n counts the rows of each half when
    gated), else the plain product's adapted by `fused_config`."""
    entry = tuned_entry(kind, n, k, 1)
    swept = (entry or {}).get(fusion.variant) if fusion.variant else None
    if swept is not None and k % swept["block_k"] == 0:
        return config_from_entry(swept)
    plain = tuned_gemv_config(kind, n, k)
    return None if plain is None else fused_config(plain, fusion)


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
            group_k: int | None, bias: torch.Tensor | None, config: GemvConfig,
            fusion: RowFusion = NO_FUSION, rope: RopeStore | None = None) -> torch.Tensor:
    n, k = weight.shape
    if rope is not None:
        assert not fusion.gated and fusion.residual is None, "rope takes a q|k|v product"
        check_rope_store(rope, n, config.block_n)
    if fusion.gated:
        assert n % 2 == 0, "a gated weight stacks gate and up halves"
        n //= 2
    y = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    has_scale = scale is not None
    grouped = has_scale and scale.shape[1] > 1
    norm_weight, residual = fusion.norm_weight, fusion.residual
    if residual is not None:
        assert residual.numel() == n and residual.is_contiguous()
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.is_contiguous()
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, scale if has_scale else weight, bias if bias is not None else weight, y,
        norm_weight if norm_weight is not None else weight,
        residual if residual is not None else weight, n, k, weight.stride(0),
        scale.stride(0) if has_scale else 0, float(fusion.eps),
        **rope_kernel_args(rope, weight), HAS_SCALE=has_scale,
        GROUPED=grouped, GROUP_K=group_k or k, HAS_BIAS=bias is not None,
        NORM=norm_weight is not None, GATED=fusion.gated, RESIDUAL=residual is not None,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EARLY_W=EARLY_WEIGHTS, VEC=config.vec,
        STEP_GROUPS=step_groups(config, group_k, grouped),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch_args(x),
        **({} if rope is None else rope_launch_options(config.num_warps)))
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, fusion: RowFusion = NO_FUSION,
         rope: RopeStore | None = None) -> torch.Tensor:
    """x [1, K] or [K] (contiguous), weight [N, K] (rows contiguous) -> [1, N] or [N]
    (N / 2 when gated). rope: a q|k|v product's rope and K/V store (kernels/gemv_rope.py)."""
    n, k = weight.shape
    assert x.shape[-1] == k and x.numel() == k and x.is_contiguous()
    assert weight.stride(1) == 1
    config = config or row_config("bf16", n, k, fusion)
    if config is None or k % config.block_k:
        raise ValueError(f"no GEMV block size divides K={k}")
    return _launch(x, weight, None, None, bias, config, fusion, rope)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             group_k: int | None, bias: torch.Tensor | None = None,
             config: GemvConfig | None = None, fusion: RowFusion = NO_FUSION,
             rope: RopeStore | None = None) -> torch.Tensor | None:
    """One row x [1, K] against FP8 codes [N, K] x scales [N, G]; None when no block size
    divides K (the caller falls back)."""
    config = fp8_gemv_config(weight, scale, group_k, config, fusion)
    if config is None:
        return None
    return _launch(x, weight, scale, group_k, bias, config, fusion, rope)


def step_groups(config: GemvConfig, group_k: int | None, grouped: bool) -> int:
    """The scale groups one BLOCK_K step of `config` spans (1 inside one, or without groups):
    the kernels' STEP_GROUPS."""
    return config.block_k // group_k if grouped and group_k and config.block_k > group_k else 1


def spans_whole_groups(config: GemvConfig, group_k: int) -> bool:
    """Whether a step of `config` may span several scale groups of `group_k` columns: whole
    groups of at least 64 columns (narrower ones, a tensor-parallel rank's cut inside a block,
    would load a scale per few columns), a power of two of them (a tile's extent), each
    holding whole vec sums."""
    groups = config.block_k // group_k
    return (WIDE_GROUP_STEPS and group_k >= 64 and groups > 1 and config.block_k % group_k == 0
            and groups & (groups - 1) == 0 and group_k % config.vec == 0)


def fp8_gemv_config(weight: torch.Tensor, scale: torch.Tensor, group_k: int | None,
                    config: GemvConfig | None = None,
                    fusion: RowFusion = NO_FUSION) -> GemvConfig | None:
    """The configuration the FP8 GEMV runs these codes with (`config`, else the swept or
    default one), or None when no block size divides K."""
    n, k = weight.shape
    config = config or row_config("fp8", n, k, fusion)
    if config is None:
        return None
    if scale.shape[1] > 1 and group_k and config.block_k > group_k:
        if not spans_whole_groups(config, group_k):
            config = config._replace(block_k=group_k)
    return None if k % config.block_k else config
