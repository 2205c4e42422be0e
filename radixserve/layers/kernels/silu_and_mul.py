"""SiLU-and-mul for a merged gate/up projection, in Triton: [T, 2I] -> silu(x[:, :I]) * x[:, I:].

Rounded like the PyTorch expression `F.silu(gate) * up`: silu is computed in float32 and rounded
to the input dtype before the product, which is computed in float32 and rounded again.

`silu_and_mul_quant` also quantises each output row for the FP8 linear after it (e4m3 codes, one
scale amax / 448 per row, as `per_token_quant` would): one program per row, which keeps the row
in registers while it finds the amax when the row fits one block (I <= 16384), else reads it
twice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue
from radixserve.layers.kernels.per_token_quant import MIN_SCALE

QUANT_BLOCK_MAX = 16384  # the widest row a quantising program holds in registers


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, n_cols, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (silu * up).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_block(X, row, stride_x, n_cols, start, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return (silu * up).to(DTYPE).to(tl.float32), cols, mask


@triton.jit
def _silu_and_mul_quant_kernel(X, Codes, Scales, stride_x, stride_c, n_cols, fp8_max, min_scale,
                               BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = X.dtype.element_ty
    if BLOCK >= n_cols:  # the whole row in registers
        y, cols, mask = _silu_mul_block(X, row, stride_x, n_cols, 0, BLOCK, dtype)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / fp8_max, min_scale)
        q = tl.clamp(y / scale, -fp8_max, fp8_max)
        tl.store(Codes + row * stride_c + cols, q.to(Codes.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            y, cols, mask = _silu_mul_block(X, row, stride_x, n_cols, start, BLOCK, dtype)
            amax = tl.maximum(amax, tl.abs(y))
        scale = tl.maximum(tl.max(amax, axis=0) / fp8_max, min_scale)
        for start in range(0, n_cols, BLOCK):
            y, cols, mask = _silu_mul_block(X, row, stride_x, n_cols, start, BLOCK, dtype)
            q = tl.clamp(y / scale, -fp8_max, fp8_max)
            tl.store(Codes + row * stride_c + cols, q.to(Codes.dtype.element_ty), mask=mask)
    tl.store(Scales + row, scale)


def silu_and_mul_quant(x: torch.Tensor, fp8_dtype: torch.dtype,
                       block: int = QUANT_BLOCK_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2I] (gate first, then up) -> (codes [M, I] fp8_dtype, scales [M, 1] float32):
    silu(gate) * up rounded to x's dtype, then quantised per row."""
    m, two_i = x.shape
    assert two_i % 2 == 0, "the last dim holds gate and up halves"
    n_cols = two_i // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    codes = torch.empty((m, n_cols), dtype=fp8_dtype, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m > 0:
        block = min(block, triton.next_power_of_2(n_cols))
        _silu_and_mul_quant_kernel[(m,)](
            x, codes, scales, x.stride(0), codes.stride(0), n_cols, torch.finfo(fp8_dtype).max,
            MIN_SCALE, BLOCK=block, num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4,
            **pdl_launch_args(x))
    return codes, scales


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x: [..., 2I] (gate first, then up) -> [..., I], a new tensor."""
    two_i = x.shape[-1]
    assert two_i % 2 == 0, "the last dim holds gate and up halves"
    n_cols = two_i // 2
    x2d = x.reshape(-1, two_i)
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty((x2d.shape[0], n_cols), dtype=x.dtype, device=x.device)
    if x2d.shape[0] > 0:
        block = min(block, triton.next_power_of_2(n_cols))
        grid = (x2d.shape[0], triton.cdiv(n_cols, block))
        _silu_and_mul_kernel[grid](x2d, out, x2d.stride(0), out.stride(0), n_cols, BLOCK=block,
                                   num_warps=4, **pdl_launch_args(x2d))
    return out.view(*x.shape[:-1], n_cols)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
