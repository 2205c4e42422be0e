"""W4A16 products on the GPU: x [M, K] (fp16 / bf16 / fp32) times a weight kept as int4 codes.

The weight arrives as layers/quantization/int4.py keeps it: int32 words [N, K / 8] (word c of a
row holds input features 8c .. 8c + 7, feature 8c + i in bits 4i .. 4i + 3, unsigned 0..15),
scales [N, G] and zero points [N, G] (uint8, or none: 8) over groups of `group_k` features.

  * One row (decode at batch 1): a GEMV that reads the words as the bf16 GEMV reads weights
    (kernels/gemv.py: a few rows a program, 512 contiguous bytes of each a step, 16-byte loads)
    and turns codes into float32 through the exponent bits where they lie (_nibbles_in_place).
    Its speed is bound by issued instructions (an AND-OR, an add and a multiply-add per code,
    and the activations' moves into the tile's layout), not by HBM: on an H100 it takes 2.1-2.7x
    the time of the bf16 GEMV over as many bytes (figures in `_gemm_shape`).
  * Up to DEQUANT_MIN_ROWS rows (decode, small prefills): one Triton kernel unpacks each
    [BLOCK_K, BLOCK_N] tile of codes in registers ((q - z) * s, in float32, then the
    activations' dtype) and feeds the tensor cores; the weight is read once, at half a byte per
    value. Few output tiles (a decode batch over a narrow layer) split K over more programs,
    whose float32 partial sums are added afterwards.
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
def _group_scale_zero(s_ptr, z_ptr, offs_n, mask_n, group, groups, HAS_ZEROS: tl.constexpr):
    """Rows offs_n's scale and zero point (8 without zero points) of group `group`, float32,
    in the shape offs_n and group broadcast to (rows [BLOCK_N] and one group, or rows
    [BLOCK_N, 1] and groups [1, G])."""
    where = offs_n * groups + group
    scale = tl.load(s_ptr + where, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + where, mask=mask_n, other=8).to(tl.float32)
    else:
        zero = tl.full(scale.shape, 8.0, tl.float32)
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
def _code_values(bits, offset, MAGIC: tl.constexpr):
    """The low 4 bits of each int32 in bits as float32, minus offset (the zero point, with
    MAGIC plus 2**23). MAGIC: the code is OR-ed into the mantissa of 2**23 (0x4B000000) and the
    word read as float32, so one add takes 2**23 and the zero point off, exactly: bit
    operations and adds at full rate instead of an int-to-float conversion, a quarter-rate
    instruction on Ampere and Hopper that bounds a one-row product (8 per word read)."""
    if MAGIC:
        values = ((bits & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - offset
    else:
        values = (bits & 0xF).to(tl.float32) - offset
    return values


@triton.jit
def _zero_offset(zero, MAGIC: tl.constexpr):
    """What _code_values subtracts for zero point zero."""
    if MAGIC:
        offset = zero + 8388608.0
    else:
        offset = zero
    return offset


@triton.jit
def _word_nibbles(qw_ptr, offs_n, mask_n, k0, k_words, BLOCK_K: tl.constexpr):
    """The [BLOCK_K / 8, BLOCK_N] words at input feature k0 (transposed), each shifted by 0, 4,
    ..., 28 bits along a middle axis: [BLOCK_K / 8, 8, BLOCK_N], nibble i of word w in the low
    bits of [w, i] (the rest above it)."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(qw_ptr + offs_n[None, :] * k_words + offs_w[:, None],
                    mask=mask_n[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    return words[:, None, :] >> shifts[None, :, None]


@triton.jit
def _unpacked_tile(qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, k_words, groups, group_k,
                   HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                   MAGIC: tl.constexpr = False):
    """The weight's [BLOCK_K, BLOCK_N] tile at input feature k0 (transposed), float32: one load
    per word, its 8 nibbles spread by a reshape (row 8w + i is word w's nibble i). MAGIC: see
    _code_values. (Session 47-48 sweeps: a load per feature, or the nibbles stacked
    nibble-major with the activations read to match, were never faster.)"""
    bits = tl.reshape(_word_nibbles(qw_ptr, offs_n, mask_n, k0, k_words, BLOCK_K),
                      (BLOCK_K, BLOCK_N))
    # group_k is a multiple of BLOCK_K: one group per tile
    scale, zero = _group_scale_zero(s_ptr, z_ptr, offs_n, mask_n, k0 // group_k, groups,
                                    HAS_ZEROS)
    return _code_values(bits, _zero_offset(zero, MAGIC)[None, :], MAGIC) * scale[None, :]


@triton.jit
def _nibbles_in_place(words, a_ptr, x_offs, zero, nibble_mask):
    """sum over the 8 nibbles of each word of (q - z) * x, float32 (the shape of words), codes
    read where they lie: nibble j (j < 4) of words and of words >> 16, masked in place and
    OR-ed into the mantissa of 2**23, is 2**23 + q * 16**j exactly; less 2**23 + z * 16**j it
    is (q - z) * 16**j, which meets x * 16**-j. One AND-OR (LOP3) per code, where a shift and
    a bit-field extract came first. nibble_mask (15) is an argument so that the four masks stay
    in registers (as constants each AND-OR would need its own move: LOP3 takes one
    immediate). x_offs: word w's first feature, 8w (+ the step's start)."""
    high = words >> 16
    part = tl.zeros(words.shape, tl.float32)
    for j in tl.static_range(4):
        mask = nibble_mask << (4 * j)
        offset = (zero * (16.0 ** j) + 8388608.0)[:, :, None]
        x_low = tl.load(a_ptr + x_offs + j).to(tl.float32) * (1.0 / 16.0 ** j)
        x_high = tl.load(a_ptr + x_offs + j + 4).to(tl.float32) * (1.0 / 16.0 ** j)
        low = ((words & mask) | 0x4B000000).to(tl.float32, bitcast=True) - offset
        part += low * x_low[None, :, :]
        upper = ((high & mask) | 0x4B000000).to(tl.float32, bitcast=True) - offset
        part += upper * x_high[None, :, :]
    return part


@triton.jit
def _int4_gemv_rows_kernel(a_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, c_ptr, N, K, k_words,
                           groups, group_k, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_N: tl.constexpr, SPAN: tl.constexpr, STEP_SPANS: tl.constexpr,
                           SPLIT_K: tl.constexpr, MAGIC: tl.constexpr, nibble_mask=15,
                           IN_PLACE: tl.constexpr = False):
    """One row, the weight read as the bf16 GEMV reads it (kernels/gemv.py): each step a
    [BLOCK_N, STEP_SPANS, SPAN / 8] tile of words, K contiguous along each weight row (vector
    loads, STEP_SPANS * SPAN / 2 bytes a row), where a span of SPAN features lies in one group
    (SPAN divides the group). No reshape: nibble i of every word meets activations 8w + i (a
    strided load from L1); each span's products are scaled by its group's scale and reduced
    over K only at the end. k_words (K / 8, the row stride) is an argument rather than computed
    so that Triton sees its divisibility by 16 and loads 16 bytes a thread (computed in the
    kernel, it let Triton prove 8). IN_PLACE: _nibbles_in_place (MAGIC implied)."""
    BLOCK_K: tl.constexpr = SPAN * STEP_SPANS
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, STEP_SPANS)
    offs_w = tl.arange(0, SPAN // 8)
    mask_n = offs_n < N
    step_words = offs_s[:, None] * (SPAN // 8) + offs_w[None, :]  # [STEP_SPANS, SPAN / 8]
    w_ptrs = qw_ptr + offs_n[:, None, None] * k_words + step_words[None, :, :]
    acc = tl.zeros((BLOCK_N, STEP_SPANS, SPAN // 8), tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        words = tl.load(w_ptrs + k0 // 8, mask=mask_n[:, None, None], other=0,
                        eviction_policy="evict_first")
        span_groups = (k0 + offs_s * SPAN) // group_k  # [STEP_SPANS]
        scale, zero = _group_scale_zero(s_ptr, z_ptr, offs_n[:, None], mask_n[:, None],
                                        span_groups[None, :], groups, HAS_ZEROS)
        if IN_PLACE:
            part = _nibbles_in_place(words, a_ptr, k0 + step_words * 8, zero, nibble_mask)
        else:
            offset = _zero_offset(zero, MAGIC)[:, :, None]
            part = tl.zeros((BLOCK_N, STEP_SPANS, SPAN // 8), tl.float32)
            for i in tl.static_range(8):
                a = tl.load(a_ptr + k0 + step_words * 8 + i).to(tl.float32)
                part += _code_values(words >> (4 * i), offset, MAGIC) * a[None, :, :]
        acc += part * scale[:, :, None]
    _store_row(tl.sum(tl.sum(acc, axis=2), axis=1), bias_ptr, c_ptr, offs_n, mask_n, pid_k, N,
               HAS_BIAS, SPLIT_K)


@triton.jit
def _int4_gemm_kernel(a_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, c_ptr, M, N, K, k_words,
                      stride_am, groups, group_k, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      MAGIC: tl.constexpr, STEP_SPANS: tl.constexpr):
    """c = a @ dequant(w).T (+ bias); with SPLIT_K > 1, c is float32 [SPLIT_K, M, N]
    partial sums (no bias). Each K step takes STEP_SPANS tiles of BLOCK_K features.
    (Zero points and scales applied after each tile's product instead, on base + q tiles,
    lost on an H100: 0.49-0.58x of cuBLAS at 8-32 rows against 0.70-0.96x; session 49.)"""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_step in range(pid_k * BLOCK_K * STEP_SPANS, K, BLOCK_K * STEP_SPANS * SPLIT_K):
        for j in tl.static_range(STEP_SPANS):  # spans side by side: longer reads of each row
            k0 = k_step + j * BLOCK_K
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :],
                        mask=mask_m[:, None], other=0.0)
            w = _unpacked_tile(qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, k_words, groups,
                               group_k, HAS_ZEROS, BLOCK_K, BLOCK_N, MAGIC).to(a.dtype)
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
def _int4_dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, k_words, groups, group_k,
                         HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, MAGIC: tl.constexpr):
    """w [N, K] = dequant(codes), in w's dtype."""
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    tile = _unpacked_tile(qw_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, k_words, groups, group_k,
                          HAS_ZEROS, BLOCK_K, BLOCK_N, MAGIC)  # [BLOCK_K, BLOCK_N]
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
    block_m: int  # 1: the row-major GEMV (one row); else the tensor-core kernel's row tile
    block_n: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    magic: bool = False  # codes to float32 through the exponent bits (_code_values)
    step_spans: int = 1  # row-major GEMV, tensor cores: BLOCK_K-feature spans per K step
    in_place: bool = False  # the row-major GEMV: _nibbles_in_place


def _gemm_shape(m: int, n: int, k: int, block_k: int, sms: int) -> GemmShape:
    """The launch shape for M rows. One row: the row-major GEMV with codes read in place, 8
    rows a program over 8 spans a step (512 bytes of each weight row), or for wide products
    (gate|up) 16 rows, 4 spans and one warp; the best of benchmarks/gpu_int4.py --sweep on an
    H100 at Llama-3.1-8B's products (q|k|v 13.3, o 10.1, gate|up 39.9, down 28.8 us). More
    rows: tensor-core tiles (the sweep's best at 16 rows, within 5%), codes through the exponent
    bits."""
    if m == 1:
        wide = n >= 16384
        spans = next(s for s in ((4, 2, 1) if wide else (8, 4, 2, 1)) if k % (block_k * s) == 0)
        block_m, step_k = 1, block_k * spans
        block_n, warps = (16, 1) if wide else (8, 4)
    else:
        spans, warps = 1, 4
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n, step_k = (64 if m <= 16 else 128), block_k
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    steps = k // step_k
    while tiles * split < 2 * sms and split * 2 <= steps // 4 and split < 16:
        split *= 2  # fill the SMs twice over, keeping at least 4 K steps per program
    return GemmShape(block_m, block_n, split, warps, magic=True, step_spans=spans,
                     in_place=m == 1)


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_k: int, dtype: torch.dtype, magic: bool = False) -> torch.Tensor:
    """The weight [N, K] in dtype (magic: _code_values' MAGIC)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    block_k = block_k_for(k, group_k)
    assert block_k is not None
    weight = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n = 64
    _int4_dequant_kernel[(triton.cdiv(n, block_n), k // block_k)](
        qweight, scales, zeros if zeros is not None else qweight, weight, n, k, k // 8,
        scales.shape[1], group_k, HAS_ZEROS=zeros is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, MAGIC=magic)
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
    block_m, block_n, split, warps, stages, magic, spans, in_place = shape
    assert k % (block_k * spans) == 0, "a K step's spans must divide K"
    assert block_m > 1 or m == 1, "the GEMV takes one row"
    out_dtype = x.dtype if split == 1 else torch.float32
    out = torch.empty((split, m, n) if split > 1 else (m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    zeros_or_any = zeros if zeros is not None else qweight
    bias_or_any = bias if bias is not None else scales
    common = dict(HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None and split == 1,
                  BLOCK_N=block_n, SPLIT_K=split, MAGIC=magic, STEP_SPANS=spans,
                  num_warps=warps, num_stages=stages)
    if block_m == 1:
        _int4_gemv_rows_kernel[grid](x2, qweight, scales, zeros_or_any, bias_or_any, out, n, k,
                                     k // 8, scales.shape[1], group_k, SPAN=block_k,
                                     IN_PLACE=in_place, **common)
    else:
        _int4_gemm_kernel[grid](x2, qweight, scales, zeros_or_any, bias_or_any, out, m, n, k,
                                k // 8, x2.stride(0), scales.shape[1], group_k,
                                IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
                                BLOCK_K=block_k, **common)
    if split > 1:
        summed = out.sum(dim=0)
        if bias is not None:
            summed += bias.float()
        out = summed.to(x.dtype)
    return out.reshape(*lead, n)

