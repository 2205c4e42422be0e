"""W4A16 products on the GPU: x [M, K] (fp16 / bf16 / fp32) times a weight kept as int4 codes.

The weight arrives as layers/quantization/int4.py keeps it: int32 words [N, K / 8] (word c of a
row holds input features 8c .. 8c + 7, feature 8c + i in bits 4i .. 4i + 3, unsigned 0..15),
scales [N, G] and zero points [N, G] (uint8, or none: 8) over groups of `group_k` features.

  * Up to DEQUANT_MIN_ROWS rows (decode, small prefills): one Triton kernel unpacks each
    [BLOCK_K, BLOCK_N] tile of codes in registers ((q - z) * s, in float32, then the
    activations' dtype) and feeds the tensor cores; the weight is read once, at half a byte per
    value. One row runs a multiply-add GEMV over the same tiles instead. Few output tiles (a
    decode batch over a narrow layer) split K over more programs, whose float32 partial sums
    are added afterwards.
  * More rows (prefill): the weight is dequantised once into a scratch [N, K] in the
    activations' dtype and cuBLAS multiplies; the product's compute dwarfs the extra pass.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization.int4 import dequantize_packed

DEQUANT_MIN_ROWS = 256  # from here on: dequantise, then cuBLAS (vLLM's AWQ threshold too)
BLOCK_KS = (128, 64, 32, 16)  # K steps tried, widest first: each must divide K and the group


@triton.jit
def _group_scale_zero(s_ptr, z_ptr, offs_n, mask_n, group, groups, HAS_ZEROS: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Rows offs_n's scale and zero point (8 without zero points) of one group, float32."""
    scale = tl.load(s_ptr + offs_n * groups + group, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + offs_n * groups + group, mask=mask_n, other=8).to(tl.float32)
    else:
        zero = tl.full((BLOCK_N,), 8.0, tl.float32)
    return scale, zero


@triton.jit
def _store_row(acc, bias_ptr, c_ptr, offs_n, mask_n, pid_k, N, HAS_BIAS: tl.constexpr,
               SPLIT_K: tl.constexpr):
    """A one-row kernel's output: c (+ bias) in c's dtype, or with SPLIT_K > 1 this program's
    float32 partial sums at [pid_k, 0, :] (the bias is added after their sum)."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(c_ptr + offs_n, acc.to(c_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(c_ptr + pid_k * N + offs_n, acc, mask=mask_n)


@triton.jit
def _unpacked_tile(qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, k_words, groups, group_k,
                   HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                   REPEAT_LOADS: tl.constexpr = False):
    """The weight's [BLOCK_K, BLOCK_N] tile at input feature k0 (transposed), float32.
    REPEAT_LOADS: each feature loads its own word (8 loads of one address, served by L1) and
    shifts it, instead of one load per word whose 8 nibbles are spread by a reshape."""
    if REPEAT_LOADS:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        words = tl.load(qw_ptr + offs_n[None, :] * k_words + (offs_k // 8)[:, None],
                        mask=mask_n[None, :], other=0)  # [BLOCK_K, BLOCK_N]
        codes = ((words >> ((offs_k % 8) * 4)[:, None]) & 0xF).to(tl.float32)
    else:
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(qw_ptr + offs_n[None, :] * k_words + offs_w[:, None],
                        mask=mask_n[None, :], other=0)  # [BLOCK_K / 8, BLOCK_N]
        shifts = tl.arange(0, 8) * 4
        codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]
        codes = tl.reshape(codes, (BLOCK_K, BLOCK_N)).to(tl.float32)
    # group_k is a multiple of BLOCK_K: one group per tile
    scale, zero = _group_scale_zero(s_ptr, z_ptr, offs_n, mask_n, k0 // group_k, groups,
                                    HAS_ZEROS, BLOCK_N)
    return (codes - zero[None, :]) * scale[None, :]


@triton.jit
def _int4_gemv_kernel(a_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, c_ptr, N, K, groups, group_k,
                      HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      REPEAT_LOADS: tl.constexpr):
    """One row: c = a @ dequant(w).T (+ bias) as multiply-adds, no tensor cores; with
    SPLIT_K > 1, c is float32 [SPLIT_K, 1, N] partial sums (no bias)."""
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    k_words = K // 8
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        a = tl.load(a_ptr + k0 + offs_k).to(tl.float32)
        w = _unpacked_tile(qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, k_words, groups, group_k,
                           HAS_ZEROS, BLOCK_K, BLOCK_N, REPEAT_LOADS)
        acc += tl.sum(w * a[:, None], axis=0)
    _store_row(acc, bias_ptr, c_ptr, offs_n, mask_n, pid_k, N, HAS_BIAS, SPLIT_K)


@triton.jit
def _int4_gemv_rows_kernel(a_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, c_ptr, N, K, groups,
                           group_k, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SPLIT_K: tl.constexpr):
    """One row, the weight read as the bf16 GEMV reads it (kernels/gemv.py): [BLOCK_N, BLOCK_K
    / 8] words with K contiguous last (vector loads along each weight row), unpacked to
    [BLOCK_N, BLOCK_K] and reduced along K. The scale and zero point leave the inner product:
    per row sum(q * x) - z * sum(x), times s, once per step (BLOCK_K divides the group)."""
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    k_words = K // 8
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        a = tl.load(a_ptr + k0 + offs_k).to(tl.float32)
        words = tl.load(qw_ptr + offs_n[:, None] * k_words + (k0 // 8 + offs_w)[None, :],
                        mask=mask_n[:, None], other=0)  # [BLOCK_N, BLOCK_K / 8]
        codes = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_K / 8, 8]
        codes = tl.reshape(codes, (BLOCK_N, BLOCK_K)).to(tl.float32)
        dot = tl.sum(codes * a[None, :], axis=1)
        scale, zero = _group_scale_zero(s_ptr, z_ptr, offs_n, mask_n, k0 // group_k, groups,
                                        HAS_ZEROS, BLOCK_N)
        acc += scale * (dot - zero * tl.sum(a, axis=0))
    _store_row(acc, bias_ptr, c_ptr, offs_n, mask_n, pid_k, N, HAS_BIAS, SPLIT_K)


@triton.jit
def _int4_gemm_kernel(a_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, c_ptr, M, N, K, stride_am,
                      groups, group_k, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      REPEAT_LOADS: tl.constexpr):
    """c = a @ dequant(w).T (+ bias); with SPLIT_K > 1, c is float32 [SPLIT_K, M, N]
    partial sums (no bias)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_words = K // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :],
                    mask=mask_m[:, None], other=0.0)
        w = _unpacked_tile(qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, k_words, groups, group_k,
                           HAS_ZEROS, BLOCK_K, BLOCK_N, REPEAT_LOADS).to(a.dtype)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = c_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    else:
        out = c_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _int4_dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, groups, group_k,
                         HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """w [N, K] = dequant(codes), in w's dtype."""
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    tile = _unpacked_tile(qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, K // 8, groups, group_k,
                          HAS_ZEROS, BLOCK_K, BLOCK_N)  # [BLOCK_K, BLOCK_N]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + offs_n[None, :] * K + offs_k[:, None], tile.to(w_ptr.dtype.element_ty),
             mask=mask_n[None, :])


def block_k_for(k: int, group_k: int) -> int | None:
    """The widest K step that divides both the input features and the group, or None."""
    for block in BLOCK_KS:
        if k % block == 0 and group_k % block == 0:
            return block
    return None


INTERPRETER_SMS = 4  # CPU tensors (the Triton interpreter in tests): a small GPU's worth


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    return _cuda_sm_count(device.index or 0) if device.type == "cuda" else INTERPRETER_SMS


class GemmShape(NamedTuple):
    block_m: int  # 1: the multiply-add GEMV (one row); else the tensor-core kernel's row tile
    block_n: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    repeat_loads: bool = False  # _unpacked_tile's REPEAT_LOADS
    row_major: bool = False  # one row: _int4_gemv_rows_kernel (weight rows, K last)


def _gemm_shape(m: int, n: int, k: int, block_k: int, sms: int) -> GemmShape:
    """The launch shape for M rows (a default, not yet swept on a GPU)."""
    block_m = 1 if m == 1 else (16 if m <= 16 else (32 if m <= 32 else 64))
    block_n = 64 if m <= 16 else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    steps = k // block_k
    while tiles * split < 2 * sms and split * 2 <= steps // 4 and split < 16:
        split *= 2  # fill the SMs twice over, keeping at least 4 K steps per program
    return GemmShape(block_m, block_n, split)


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in dtype."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    block_k = block_k_for(k, group_k)
    assert block_k is not None
    weight = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n = 64
    _int4_dequant_kernel[(triton.cdiv(n, block_n), k // block_k)](
        qweight, scales, zeros if zeros is not None else qweight, weight, n, k,
        scales.shape[1], group_k, HAS_ZEROS=zeros is not None, BLOCK_N=block_n,
        BLOCK_K=block_k)
    return weight


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, group_k: int, bias: torch.Tensor | None,
                shape: GemmShape | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(W).T (+ bias) -> [..., N] in x.dtype. shape: the Triton kernel's
    launch shape (benchmarks/gpu_int4.py sweeps them; default `_gemm_shape`)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[0]
    block_k = block_k_for(k, group_k)
    if m >= DEQUANT_MIN_ROWS or block_k is None or m == 0:
        weight = int4_dequantize(qweight, scales, zeros, group_k, x.dtype) if block_k else \
            dequantize_packed(qweight, scales, zeros, group_k, x.dtype)
        return torch.nn.functional.linear(x, weight, bias)
    if shape is None:
        shape = _gemm_shape(m, n, k, block_k, _sm_count(x.device))
    block_m, block_n, split, warps, stages, repeat, row_major = shape
    out_dtype = x.dtype if split == 1 else torch.float32
    out = torch.empty((split, m, n) if split > 1 else (m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    zeros_or_any = zeros if zeros is not None else qweight
    bias_or_any = bias if bias is not None else scales
    common = dict(HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None and split == 1,
                  BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, REPEAT_LOADS=repeat,
                  num_warps=warps, num_stages=stages)
    if block_m == 1 and row_major:
        assert m == 1, "the GEMV takes one row"
        common.pop("REPEAT_LOADS")
        _int4_gemv_rows_kernel[grid](x2, qweight, scales, zeros_or_any, bias_or_any, out, n, k,
                                     scales.shape[1], group_k, **common)
    elif block_m == 1:
        assert m == 1, "the GEMV takes one row"
        _int4_gemv_kernel[grid](x2, qweight, scales, zeros_or_any, bias_or_any, out, n, k,
                                scales.shape[1], group_k, **common)
    else:
        _int4_gemm_kernel[grid](x2, qweight, scales, zeros_or_any, bias_or_any, out, m, n, k,
                                x2.stride(0), scales.shape[1], group_k,
                                IEEE=x.dtype == torch.float32, BLOCK_M=block_m, **common)
    if split > 1:
        summed = out.sum(dim=0)
        if bias is not None:
            summed += bias.float()
        out = summed.to(x.dtype)
    return out.reshape(*lead, n)

