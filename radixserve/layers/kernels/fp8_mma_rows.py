"""A few rows (decode: 1-16, or up to 128 rows of activation codes) against FP8 weight codes on
the FP8 tensor cores, in Triton.

The FP8 GEMV (gemv.py) and the skinny tile GEMM (skinny_gemm.py) convert every weight code to
float32 or bf16 in registers before they multiply: twice the ALU work per byte of a bf16
weight, which keeps them at 1.4-3.5 TB/s on an H200 where the copy rate is 4.25. Here the codes
go from memory to the MMA as they are (Hopper's e4m3 x e4m3 products, fp32 accumulation). The
activations are quantised instead, in registers: a prologue pass over the program's columns
finds each row's amax (after RMSNorm's weight when the norm is fused, whose sum of squares it
takes too), and every K step turns its slice of the rows into e4m3 codes with that one scale
(amax / 448), so the MMAs accumulate in place and no separate quantisation pass runs. X_TERMS
= 1 is the dynamic FP8 activations `--quantization fp8` specifies (~2^-4 relative per
element); X_TERMS = 2 quantises the remainder x / s - hi again (lo, scaled by 16) and
multiplies it too, x ~ s * (hi + lo / 16), ~2^-8 like bf16, for a second MMA per step (5-30%
of the time on the H200). Activations may also arrive as codes already (X_CODES, per_token_quant's
codes and row scales): then both operands go from memory to the MMA.

The weight rows are the MMA's first operand (BLOCK_N of them, 64 or 128: Hopper's wgmma takes
64 rows per warp group), the rows of x its second (padded to BLOCK_M: 16, or the next power of
two for more rows), and the tile is stored transposed. Each weight tile is read once whatever
BLOCK_M is, so up to ~128 rows the product stays bound by the weight bytes (FP8 at 4 TB/s and
~1 PFLOP/s cross over near 125 rows). K may be split over SPLIT_K programs per tile: each leaves its partial tile in
a workspace and the last to arrive (an int32 counter per tile, reset by that program) adds them
up and runs the epilogue, so the fusions below need no second kernel. Scales: per output row
once at the end, or (GROUPED) per K group of GROUP_K columns on each step's product. The
one-row fusions of gemv.py (RowFusion: RMSNorm in the prologue, SiLU-mul of gate|up, the
residual add) work per row here as there. benchmarks/gpu_fp8_mma.py sweeps the configurations
into the fp8 tables (`tuned_config`); PERFORMANCE.md, "H200, session 11", has the figures.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixserve.core.tile_counters import tile_counters
from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue
from radixserve.layers.kernels.gemm_tables import tuned_entry
from radixserve.layers.kernels.gemv import NO_FUSION, RowFusion

MAX_ROWS = 16  # the rows of x one launch quantises in registers (the MMA's second operand)
# the rows of activation codes (x_scale given) one launch takes: the prologue's amax tile and
# the second term's accumulators that quantising in registers needs grow with the rows
MAX_CODE_ROWS = 128
# RADIXSERVE_FP8_MMA=0 keeps FP8 decode products on the converting kernels (for A/B timing)
ENABLED = os.environ.get("RADIXSERVE_FP8_MMA", "1") != "0"


class MmaRowsConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    x_terms: int = 2
    split_k: int = 1


@triton.jit
def _fp8_mma_rows_kernel(X, XScale, W, Scale, B, Y, NormW, Residual, Work, Counters, M, N, K,
                         k_per_split, stride_xm, stride_wn, stride_sn, stride_ym, stride_rm,
                         eps, GROUPED: tl.constexpr, GROUP_K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                         RESIDUAL: tl.constexpr, X_TERMS: tl.constexpr, ONE_ROW: tl.constexpr,
                         X_CODES: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """N: the output columns; GATED reads gate rows [0, N) and up rows [N, 2N) of W.
    X_CODES: X holds e4m3 codes already, with one scale per row in XScale (no NORM, one term):
    both operands go from memory to the MMA.
    program_id(1) takes K columns [s * k_per_split, (s + 1) * k_per_split); with SPLIT_K > 1
    each program leaves its partial tile in Work and the last of a tile's programs to arrive
    (Counters, one per tile, left at zero) adds them up and runs the epilogue."""
    pdl_prologue(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + k_begin + offs_k[None, :]
    x_ptrs = X + offs_m[None, :] * stride_xm + k_begin + offs_k[:, None]
    up_rows = N.to(tl.int64) * stride_wn  # GATED: the up half starts N rows down
    # the prologue: each row's amax over this program's columns (after the norm's weight),
    # which scales its codes, and the row's sum of squares for RMSNorm's 1/rms
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    if X_CODES:
        row_scale = tl.load(XScale + offs_m, mask=m_mask, other=1.0)
    elif ONE_ROW:
        amax_v = tl.zeros([BLOCK_K], dtype=tl.float32)
        squares_v = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k_start in range(k_begin, k_end, BLOCK_K):
            xv = tl.load(X + k_start + offs_k).to(tl.float32)
            if NORM:
                squares_v += xv * xv
                xv = xv * tl.load(NormW + k_start + offs_k).to(tl.float32)
            amax_v = tl.maximum(amax_v, tl.abs(xv))
        one_scale = tl.maximum(tl.max(amax_v, axis=0), 1e-30) / 448.0
        one_inv = 1.0 / one_scale
        row_scale = tl.where(offs_m == 0, one_scale, 1.0)
        squares = tl.where(offs_m == 0, tl.sum(squares_v, axis=0), 0.0)
    else:
        amax = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
        prologue_ptrs = x_ptrs
        for k_start in range(k_begin, k_end, BLOCK_K):
            x = tl.load(prologue_ptrs, mask=m_mask[None, :], other=0.0).to(tl.float32)
            if NORM:
                squares += tl.sum(x * x, axis=0)
                x = x * tl.load(NormW + k_start + offs_k).to(tl.float32)[:, None]
            amax = tl.maximum(amax, tl.abs(x))
            prologue_ptrs += BLOCK_K
        row_scale = tl.maximum(tl.max(amax, axis=0), 1e-30) / 448.0  # amax / e4m3's largest
        inv = 1.0 / row_scale  # [BLOCK_M]
    col0 = offs_m[None, :] == 0
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up_lo = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        if X_CODES:
            hi = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        elif ONE_ROW:  # the row's step as a vector; the MMA operand is it in column 0, else 0
            xv = tl.load(X + k_start + offs_k).to(tl.float32)
            if NORM:
                xv = xv * tl.load(NormW + k_start + offs_k).to(tl.float32)
            scaled_v = xv * one_inv  # within +-448, e4m3's range
            hi_v = scaled_v.to(tl.float8e4nv).to(tl.float32)
            hi = tl.where(col0, hi_v[:, None], 0.0).to(tl.float8e4nv)
            if X_TERMS == 2:  # the remainder, at most half a step of hi: x 16 stays in range
                lo = tl.where(col0, ((scaled_v - hi_v) * 16.0)[:, None],
                              0.0).to(tl.float8e4nv)
        else:
            x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0).to(tl.float32)
            if NORM:
                x = x * tl.load(NormW + k_start + offs_k).to(tl.float32)[:, None]
            scaled = x * inv[None, :]
            hi = scaled.to(tl.float8e4nv)
            if X_TERMS == 2:
                lo = ((scaled - hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
        if GATED:
            w_up = tl.load(w_ptrs + up_rows, mask=n_mask[:, None], other=0.0,
                           eviction_policy="evict_first")
        if GROUPED:  # each step's weight scales, per row: the products are scaled first
            s_ptrs = Scale + offs_n * stride_sn + k_start // GROUP_K
            s = tl.load(s_ptrs, mask=n_mask, other=0.0)[:, None]
            acc += tl.dot(w, hi) * s
            if X_TERMS == 2:
                acc_lo += tl.dot(w, lo) * s
            if GATED:
                s_up = tl.load(s_ptrs + N * stride_sn, mask=n_mask, other=0.0)[:, None]
                acc_up += tl.dot(w_up, hi) * s_up
                if X_TERMS == 2:
                    acc_up_lo += tl.dot(w_up, lo) * s_up
        else:  # the MMAs accumulate in place
            acc = tl.dot(w, hi, acc)
            if X_TERMS == 2:
                acc_lo = tl.dot(w, lo, acc_lo)
            if GATED:
                acc_up = tl.dot(w_up, hi, acc_up)
                if X_TERMS == 2:
                    acc_up_lo = tl.dot(w_up, lo, acc_up_lo)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if X_TERMS == 2:
        acc += acc_lo * 0.0625
        acc_up += acc_up_lo * 0.0625
    acc = acc * row_scale[None, :]
    if GATED:
        acc_up = acc_up * row_scale[None, :]
    if SPLIT_K == 1:
        _epilogue(acc, acc_up, squares, offs_n, offs_m, n_mask, m_mask, N, K, eps, Scale, B,
                  Y, Residual, stride_sn, stride_ym, stride_rm, GROUPED, HAS_BIAS, NORM,
                  GATED, RESIDUAL)
    else:
        tiles = tl.num_programs(0)
        tile_elems = BLOCK_N * BLOCK_M
        offs_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        part_ptrs = Work + (pid_k * tiles + pid_n).to(tl.int64) * tile_elems + offs_tile
        up_offset = SPLIT_K * tiles * tile_elems  # where the up halves' partials start
        sq_ptrs = Work + up_offset * (2 if GATED else 1) + (pid_k * tiles + pid_n) * BLOCK_M \
            + offs_m
        tl.store(part_ptrs, acc)
        if GATED:
            tl.store(part_ptrs + up_offset, acc_up)
        if NORM:
            tl.store(sq_ptrs, squares)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last of the tile's programs: sum and finish
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            squares = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                step = (s - pid_k) * tiles  # in tiles, from this program's own partial
                acc += tl.load(part_ptrs + step * tile_elems, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part_ptrs + up_offset + step * tile_elems,
                                      cache_modifier=".cg")
                if NORM:
                    squares += tl.load(sq_ptrs + step * BLOCK_M, cache_modifier=".cg")
            tl.atomic_xchg(Counters + pid_n, 0)  # ready for the next launch
            _epilogue(acc, acc_up, squares, offs_n, offs_m, n_mask, m_mask, N, K, eps, Scale,
                      B, Y, Residual, stride_sn, stride_ym, stride_rm, GROUPED, HAS_BIAS,
                      NORM, GATED, RESIDUAL)


@triton.jit
def _epilogue(acc, acc_up, squares, offs_n, offs_m, n_mask, m_mask, N, K, eps, Scale, B, Y,
              Residual, stride_sn, stride_ym, stride_rm, GROUPED: tl.constexpr,
              HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
              RESIDUAL: tl.constexpr):
    """1/rms, scales, bias, SiLU-mul and the residual add of the finished transposed tile,
    stored as rows of Y."""
    if NORM:
        inv_rms = tl.rsqrt(squares / K + eps)
        acc = acc * inv_rms[None, :]
        acc_up = acc_up * inv_rms[None, :]
    y = _rows_scale_and_bias(acc, offs_n, n_mask, 0, Scale, B, stride_sn, GROUPED, HAS_BIAS)
    if GATED:  # silu(gate) * up, each rounded as the unfused layers round them
        up = _rows_scale_and_bias(acc_up, offs_n, n_mask, N, Scale, B, stride_sn, GROUPED,
                                  HAS_BIAS)
        gate = y.to(Y.dtype.element_ty).to(tl.float32)
        up = up.to(Y.dtype.element_ty).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32) * up
    out_mask = n_mask[:, None] & m_mask[None, :]
    if RESIDUAL:  # the residual stream's add, rounded as torch's add of two rounded tensors
        r = tl.load(Residual + offs_m[None, :] * stride_rm + offs_n[:, None], mask=out_mask,
                    other=0.0).to(tl.float32)
        y = y.to(Y.dtype.element_ty).to(tl.float32) + r
    tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], y.to(Y.dtype.element_ty),
             mask=out_mask)


@triton.jit
def _rows_scale_and_bias(acc, offs_n, n_mask, row_offset, Scale, B, stride_sn,
                         GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Per-output-row scales (unless GROUPED: applied per step) and bias of the transposed
    tile acc [BLOCK_N, BLOCK_M] for weight rows offs_n + row_offset."""
    if not GROUPED:
        acc = acc * tl.load(Scale + (offs_n + row_offset) * stride_sn, mask=n_mask,
                            other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(B + offs_n + row_offset, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    return acc


def tuned_config(n: int, k: int, m: int, variant: str = "") -> MmaRowsConfig | None:
    """The swept configuration for m rows against an [n, k] FP8 weight with the fusion
    `variant` (RowFusion.variant): the "mma" key of the fp8 table's entry for m
    (benchmarks/gpu_fp8_mma.py --write), present only where this kernel beat the converting
    one; None otherwise."""
    entry = ((tuned_entry("fp8", n, k, m) or {}).get("mma") or {}).get(variant)
    if entry is None or k % entry["block_k"]:
        return None
    return MmaRowsConfig(entry["block_n"], entry["block_k"], entry["num_warps"],
                         entry["num_stages"], entry.get("x_terms", 2), entry.get("split_k", 1))


def within_group(config: MmaRowsConfig, group_k: int) -> MmaRowsConfig | None:
    """The configuration with its K step inside one scale group of group_k columns (None if
    no power-of-two step of at least 32 divides the group)."""
    block_k = config.block_k
    while block_k >= 32 and group_k % block_k:
        block_k //= 2
    return config._replace(block_k=block_k) if block_k >= 32 else None


@functools.lru_cache(maxsize=None)
def _has_fp8_mma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def available(x: torch.Tensor) -> bool:
    """Whether x's device runs e4m3 MMAs (CUDA capability 8.9 and later; the interpreter on
    CPU tensors), unless RADIXSERVE_FP8_MMA=0."""
    if not ENABLED:
        return False
    if not x.is_cuda:
        return os.environ.get("TRITON_INTERPRET") == "1"
    return _has_fp8_mma(x.device.index if x.device.index is not None
                        else torch.cuda.current_device())


def block_rows(m: int) -> int:
    """The MMA's row tile for m rows: 16 (its smallest), else the next power of two."""
    return max(16, triton.next_power_of_2(m))


def fp8_mma_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 group_k: int | None, config: MmaRowsConfig,
                 bias: torch.Tensor | None = None, fusion: RowFusion = NO_FUSION,
                 x_scale: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous; M <= MAX_ROWS) against FP8 codes [N, K] x scales [N, G] ->
    [M, N] in x's dtype (N / 2 when gated), with `config` (`tuned_config`'s, or a sweep's); see
    RowFusion for `fusion`. x_scale [M, 1] float32: x holds e4m3 codes already (per_token_quant's;
    M <= MAX_CODE_ROWS), the output in out_dtype; no norm fusion then."""
    n, k = weight.shape
    m = x.shape[0]
    max_rows = MAX_CODE_ROWS if x_scale is not None else MAX_ROWS
    assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1 and 0 < m <= max_rows
    assert weight.stride(1) == 1
    if x_scale is not None:
        assert x.dtype == torch.float8_e4m3fn and fusion.norm_weight is None
        assert x_scale.numel() == m and out_dtype is not None
    grouped = scale.shape[1] > 1
    if k % config.block_k:
        raise ValueError(f"the step width {config.block_k} does not divide K={k}")
    if grouped:
        assert group_k and group_k % config.block_k == 0, "a step must stay in one scale group"
    if fusion.gated:
        assert n % 2 == 0, "a gated weight stacks gate and up halves"
        n //= 2
    norm_weight, residual = fusion.norm_weight, fusion.residual
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(1) == 1
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.is_contiguous()
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    tiles = triton.cdiv(n, config.block_n)
    rows = block_rows(m)
    split = config.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)  # no program without columns
    work = counters = y
    if split > 1:
        halves = 2 if fusion.gated else 1
        work = torch.empty(split * tiles * (rows * config.block_n * halves + rows),
                           dtype=torch.float32, device=x.device)
        counters = tile_counters(x.device, tiles)
    _fp8_mma_rows_kernel[(tiles, split)](
        x, x_scale if x_scale is not None else scale, weight, scale,
        bias if bias is not None else weight, y,
        norm_weight if norm_weight is not None else weight,
        residual if residual is not None else weight, work, counters, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        residual.stride(0) if residual is not None else 0, float(fusion.eps),
        GROUPED=grouped, GROUP_K=group_k or k, HAS_BIAS=bias is not None,
        NORM=norm_weight is not None, GATED=fusion.gated, RESIDUAL=residual is not None,
        X_TERMS=1 if x_scale is not None else config.x_terms,
        ONE_ROW=m == 1 and x_scale is None, X_CODES=x_scale is not None, SPLIT_K=split,
        BLOCK_M=rows, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch_args(x))
    return y
