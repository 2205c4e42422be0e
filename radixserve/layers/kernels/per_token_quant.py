"""Dynamic per-token FP8 quantisation of activations, one Triton program per row.

Before an FP8 x FP8 product (torch._scaled_mm) every row of x [M, K] gets its own scale
amax(|row|) / FP8_MAX and is stored as FP8 codes. In PyTorch ops that is six passes over a float32
copy of x; here each program reads its row once to find the amax (in BLOCK chunks), then again to
quantise it (from L2: a row is at most a few tens of KB), and writes one byte per value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue
from radixserve.layers.quantization.fp8 import FP8_MIN_ROW_SCALE as MIN_SCALE, quantize_rows


@triton.jit
def _per_token_quant_kernel(X, Q, Scale, K, stride_x, stride_q, fp8_max, min_scale,
                            BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        x = tl.load(X + row * stride_x + start + offs, mask=start + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / fp8_max, min_scale)
    tl.store(Scale + row, scale)
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        x = tl.load(X + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -fp8_max, fp8_max)
        tl.store(Q + row * stride_q + start + offs, q.to(Q.dtype.element_ty), mask=mask)


def per_token_quant(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """x [M, K] (rows contiguous) -> (codes [M, K] fp8_dtype, scales [M, 1] float32)."""
    m, k = x.shape
    assert x.stride(1) == 1
    codes = torch.empty(m, k, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(k), 2048)
        _per_token_quant_kernel[(m,)](x, codes, scales, k, x.stride(0), codes.stride(0),
                                      torch.finfo(fp8_dtype).max, MIN_SCALE, BLOCK=block,
                                      num_warps=4, **pdl_launch_args(x))
    return codes, scales


def per_token_quant_reference(x: torch.Tensor, fp8_dtype: torch.dtype
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    rows = quantize_rows(x, fp8_dtype)
    return rows.codes, rows.scales
