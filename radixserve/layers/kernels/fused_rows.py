"""A few rows (small-batch decode, 2-8 tokens) through one decode product with its neighbours
fused, bf16/fp16 weights, on the CUDA cores in Triton: the multi-row sibling of gemv.py's
RowFusion.

At 2-8 rows a Llama layer's products read their weights in 12-58 µs each, and the RMSNorms,
SiLU-mul and the cuBLAS launches between them (cuBLAS takes no programmatic dependent launch, so
each leaves a gap in the graph) add ~10 µs per layer. Here the four products carry them, as the
one-row GEMVs do:
  norm:     x is the residual stream; each K step multiplies its columns by the norm's weight
            and adds their squares into the row's sum, and the row's 1/rms scales the output at
            the end (exact in real arithmetic: the norm is linear per row);
  gated:    the weight stacks gate and up rows; each program holds both tiles' products and
            writes silu(gate) * up, rounded as the unfused kernels round them;
  residual: the output is residual + product (the residual stream's next value).
The product is gemv.py's, widened: each program owns BLOCK_N output columns for all rows over
the whole of K (no split: the norm needs every column's square, the epilogues the finished
sums), multiplies each weight tile [BLOCK_N, BLOCK_K] by every row's x tile elementwise into
a float32 accumulator of that shape per row (the rows unrolled) and reduces them once at the
end. A weight element costs one FMA per row, about half the H200's FMA rate at 8 rows and its
weight-read rate; measured, the per-row work around the FMA (each row's x moved to the weight
tile's layout per K step, the norm's per-column work) binds the kernel from 4 rows on, and at
2 rows the plain product wins (session 24; a 16-row tensor-core tile with the norm in its
prologue was slower than cuBLAS at every row count, session 23). The first weight tile is
loaded before the PDL wait (as gemv.py's EARLY_W). Configurations per product and row count
come from the swept tables (gemm_tables: the variant's name inside the M entry,
benchmarks/gpu_rows_fusion.py --write); without an entry the layer runs unfused. Without
fusions (the entry's "plain" key) the kernel is also linear()'s for 2-8 rows where the sweep
found it faster than cuBLAS or the skinny GEMM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue
from radixserve.layers.kernels.gemm_tables import tuned_entry
from radixserve.layers.kernels.gemv import (EARLY_WEIGHTS, GemvConfig, RowFusion,
                                            config_from_entry, first_weight_step,
                                            load_weight_tiles, squares_total,
                                            store_row_epilogue, vec_sum)

MAX_ROWS = 8  # one FMA per weight element and row (linear.MAX_FUSED_ROWS)


# The GEMV's configuration, widened: block_n output columns per program (of each half when
# gated), and with vec > 1 each thread's vec products of a row summed before they are
# accumulated, so each row's accumulator is [block_n, block_k / vec] (at 8 rows the difference
# between spilling and not)
RowsConfig = GemvConfig


@triton.jit
def _row_step(acc, acc_up, squares, w, w_up, x_row, k_start, offs_k, gamma, NORM: tl.constexpr,
              GATED: tl.constexpr, VEC: tl.constexpr):
    """One K step of one row: its x tile (normed: times the norm's weight) times the float32
    weight tile(s), elementwise into the row's accumulators (VEC > 1: each thread's VEC
    products summed first)."""
    x = tl.load(x_row + k_start + offs_k).to(tl.float32)
    if NORM:
        squares += x * x
        x = x * gamma
    acc += vec_sum(w * x[None, :], VEC)
    if GATED:
        acc_up += vec_sum(w_up * x[None, :], VEC)
    return acc, acc_up, squares


@triton.jit
def _rows_step(a0, a1, a2, a3, a4, a5, a6, a7, u0, u1, u2, u3, u4, u5, u6, u7, s0, s1, s2, s3,
               s4, s5, s6, s7, w, w_up, X, stride_xm, NormW, k_start, offs_k,
               ROWS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, VEC: tl.constexpr):
    """One K step of every row. The rows are unrolled (ROWS is M itself) so that each row's
    accumulator keeps the weight tile's register layout: a [M, BLOCK_N, BLOCK_K] product has
    Triton move the weight tile between layouts through shared memory every step (sm_90 code
    compiled on a CPU, session 24). Each row's x (its squares, the norm's weight) is worked on
    once per column, then moved to the weight tile's layout, as the one-row GEMV does."""
    w = w.to(tl.float32)
    w_up = w_up.to(tl.float32)
    gamma = w  # unused without NORM
    if NORM:
        gamma = tl.load(NormW + k_start + offs_k).to(tl.float32)
    a0, u0, s0 = _row_step(a0, u0, s0, w, w_up, X, k_start, offs_k, gamma, NORM, GATED, VEC)
    a1, u1, s1 = _row_step(a1, u1, s1, w, w_up, X + stride_xm, k_start, offs_k, gamma, NORM,
                           GATED, VEC)
    if ROWS > 2:
        a2, u2, s2 = _row_step(a2, u2, s2, w, w_up, X + 2 * stride_xm, k_start, offs_k, gamma,
                               NORM, GATED, VEC)
    if ROWS > 3:
        a3, u3, s3 = _row_step(a3, u3, s3, w, w_up, X + 3 * stride_xm, k_start, offs_k, gamma,
                               NORM, GATED, VEC)
    if ROWS > 4:
        a4, u4, s4 = _row_step(a4, u4, s4, w, w_up, X + 4 * stride_xm, k_start, offs_k, gamma,
                               NORM, GATED, VEC)
    if ROWS > 5:
        a5, u5, s5 = _row_step(a5, u5, s5, w, w_up, X + 5 * stride_xm, k_start, offs_k, gamma,
                               NORM, GATED, VEC)
    if ROWS > 6:
        a6, u6, s6 = _row_step(a6, u6, s6, w, w_up, X + 6 * stride_xm, k_start, offs_k, gamma,
                               NORM, GATED, VEC)
    if ROWS > 7:
        a7, u7, s7 = _row_step(a7, u7, s7, w, w_up, X + 7 * stride_xm, k_start, offs_k, gamma,
                               NORM, GATED, VEC)
    return a0, a1, a2, a3, a4, a5, a6, a7, u0, u1, u2, u3, u4, u5, u6, u7, s0, s1, s2, s3, s4, \
        s5, s6, s7


@triton.jit
def _row_out(acc, acc_up, squares, Y, B, Residual, offs_n, n_mask, N, K, eps,
             HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
             RESIDUAL: tl.constexpr, VEC: tl.constexpr):
    """One row's output: its sums, the norm's 1/rms, bias, silu(gate) * up and the residual
    add, stored at Y (the row's start; Residual likewise)."""
    y = tl.sum(acc, axis=1)
    if NORM:
        inv_rms = tl.rsqrt(squares_total(squares, VEC) / K + eps)
        y = y * inv_rms
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    up = y  # unused unless GATED
    if GATED:
        up = tl.sum(acc_up, axis=1)
        if NORM:
            up = up * inv_rms
        if HAS_BIAS:
            up += tl.load(B + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    store_row_epilogue(y, up, Y, Residual, offs_n, n_mask, GATED, RESIDUAL)


@triton.jit
def _fused_rows_kernel(X, W, B, Y, NormW, Residual, N, K, stride_xm, stride_wn, stride_ym,
                       stride_rm, eps, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                       GATED: tl.constexpr, RESIDUAL: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EARLY_W: tl.constexpr,
                       USE_PDL: tl.constexpr, VEC: tl.constexpr):
    """Y[ROWS, N] = epilogue(prologue(X[ROWS, K]) @ W[:N].T) for 2 <= ROWS <= 8; GATED reads
    gate rows [0, N) and up rows [N, 2N) of W. K is a multiple of BLOCK_K. EARLY_W: the
    first weight tile before the PDL wait, as gemv.py's (no kernel of a forward pass writes
    weights)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k, w_ptrs, a0, s0 = first_weight_step(W, offs_n.to(tl.int64) * stride_wn, BLOCK_N,
                                               BLOCK_K, VEC)
    up_rows = N * stride_wn
    if EARLY_W:
        w_first, w_first_up = load_weight_tiles(w_ptrs, up_rows, n_mask, GATED, VEC)
    pdl_prologue(USE_PDL)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    u0, u1, u2, u3, u4, u5, u6, u7 = a0, a0, a0, a0, a0, a0, a0, a0
    s1, s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0, s0
    k_begin = 0
    if EARLY_W:
        a0, a1, a2, a3, a4, a5, a6, a7, u0, u1, u2, u3, u4, u5, u6, u7, s0, s1, s2, s3, s4, \
            s5, s6, s7 = _rows_step(
                a0, a1, a2, a3, a4, a5, a6, a7, u0, u1, u2, u3, u4, u5, u6, u7, s0, s1, s2, s3,
                s4, s5, s6, s7, w_first, w_first_up, X, stride_xm, NormW, 0, offs_k, ROWS,
                NORM, GATED, VEC)
        w_ptrs += BLOCK_K
        k_begin = BLOCK_K
    for k_start in range(k_begin, K, BLOCK_K):
        w, w_up = load_weight_tiles(w_ptrs, up_rows, n_mask, GATED, VEC)
        a0, a1, a2, a3, a4, a5, a6, a7, u0, u1, u2, u3, u4, u5, u6, u7, s0, s1, s2, s3, s4, \
            s5, s6, s7 = _rows_step(
                a0, a1, a2, a3, a4, a5, a6, a7, u0, u1, u2, u3, u4, u5, u6, u7, s0, s1, s2, s3,
                s4, s5, s6, s7, w, w_up, X, stride_xm, NormW, k_start, offs_k, ROWS, NORM,
                GATED, VEC)
        w_ptrs += BLOCK_K
    _row_out(a0, u0, s0, Y, B, Residual, offs_n, n_mask, N, K, eps, HAS_BIAS, NORM, GATED,
             RESIDUAL, VEC)
    _row_out(a1, u1, s1, Y + stride_ym, B, Residual + stride_rm, offs_n, n_mask, N, K, eps,
             HAS_BIAS, NORM, GATED, RESIDUAL, VEC)
    if ROWS > 2:
        _row_out(a2, u2, s2, Y + 2 * stride_ym, B, Residual + 2 * stride_rm, offs_n, n_mask, N,
                 K, eps, HAS_BIAS, NORM, GATED, RESIDUAL, VEC)
    if ROWS > 3:
        _row_out(a3, u3, s3, Y + 3 * stride_ym, B, Residual + 3 * stride_rm, offs_n, n_mask, N,
                 K, eps, HAS_BIAS, NORM, GATED, RESIDUAL, VEC)
    if ROWS > 4:
        _row_out(a4, u4, s4, Y + 4 * stride_ym, B, Residual + 4 * stride_rm, offs_n, n_mask, N,
                 K, eps, HAS_BIAS, NORM, GATED, RESIDUAL, VEC)
    if ROWS > 5:
        _row_out(a5, u5, s5, Y + 5 * stride_ym, B, Residual + 5 * stride_rm, offs_n, n_mask, N,
                 K, eps, HAS_BIAS, NORM, GATED, RESIDUAL, VEC)
    if ROWS > 6:
        _row_out(a6, u6, s6, Y + 6 * stride_ym, B, Residual + 6 * stride_rm, offs_n, n_mask, N,
                 K, eps, HAS_BIAS, NORM, GATED, RESIDUAL, VEC)
    if ROWS > 7:
        _row_out(a7, u7, s7, Y + 7 * stride_ym, B, Residual + 7 * stride_rm, offs_n, n_mask, N,
                 K, eps, HAS_BIAS, NORM, GATED, RESIDUAL, VEC)


PLAIN = "plain"  # the table key of the product without fusions (linear()'s 2-8-row kernel)


def rows_config(n: int, k: int, m: int, variant: str) -> RowsConfig | None:
    """The swept configuration of a product of an [n, k] weight at M rows with a fusion (the
    `variant` key, RowFusion.variant, of the bf16 table's entry covering M; "" the plain
    product, key PLAIN), or None: not swept there, or the sweep found the kernel it would
    replace faster (then nothing is written)."""
    if not 2 <= m <= MAX_ROWS:
        return None
    swept = (tuned_entry("bf16", n, k, m) or {}).get(variant or PLAIN)
    if not swept or "block_n" not in swept or k % swept["block_k"]:
        return None
    return config_from_entry(swept)


def fused_rows(x: torch.Tensor, weight: torch.Tensor, config: RowsConfig,
               fusion: RowFusion, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (2 <= M <= 8) @ weight[N or 2N, K].T with `fusion` -> [M, N] in x's dtype
    (weight in x's dtype, rows contiguous; N half the weight's rows when gated)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if fusion.gated else weight.shape[0]
    assert 2 <= m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1
    assert weight.dtype == x.dtype and k % config.block_k == 0
    assert config.block_k % config.vec == 0
    if x.stride(1) != 1:
        x = x.contiguous()
    norm_weight, residual = fusion.norm_weight, fusion.residual
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.is_contiguous()
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _fused_rows_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, y,
        norm_weight if norm_weight is not None else weight,
        residual if residual is not None else weight, n, k, x.stride(0), weight.stride(0),
        y.stride(0), residual.stride(0) if residual is not None else 0, float(fusion.eps),
        HAS_BIAS=bias is not None, NORM=norm_weight is not None, GATED=fusion.gated,
        RESIDUAL=residual is not None, ROWS=m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, EARLY_W=EARLY_WEIGHTS, num_warps=config.num_warps,
        VEC=config.vec, num_stages=config.num_stages, **pdl_launch_args(x))
    return y
