"""RMSNorm with an optional fused residual add, in Triton, rounded the way HF transformers is.

With a residual: s = x + residual (rounded to the promoted dtype, as torch adds), returned as the
new residual; the norm is taken of s. The norm runs in float32, is rounded to s's dtype, then
multiplied by the weight: out = weight * (s * rsqrt(mean(s^2) + eps)).to(s.dtype), exactly the
order of HF's LlamaRMSNorm, so the GPU path and the PyTorch path agree up to float32 rounding of
the mean. FP32_WEIGHT (Gemma's, Qwen3-Next's and Qwen3.5's RMSNorm with weight_offset 1, OLMo's
with 0): out = (s * rsqrt(...) * (weight + weight_offset)) in float32, rounded once at the end,
as transformers' GemmaRMSNorm and Olmo2RMSNorm do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue
from radixserve.layers.kernels.per_token_quant import MIN_SCALE


@triton.jit
def _rmsnorm_kernel(X, Residual, W, Out, ResidualOut, Scales, stride_x, stride_r, stride_o,
                    stride_ro, n_cols, eps, fp8_max, min_scale, weight_offset,
                    HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr, FP32_WEIGHT: tl.constexpr = False):
    """QUANT: Out holds FP8 codes of the output rounded to X's dtype, Scales one scale per row."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ResidualOut.dtype.element_ty)
        tl.store(ResidualOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if FP32_WEIGHT:
        normed = xf * tl.rsqrt(variance + eps)
        w = w + weight_offset
    else:
        normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype).to(tl.float32)
    if QUANT:  # as per_token_quant takes the rounded output
        y = (normed * w).to(X.dtype.element_ty).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / fp8_max, min_scale)
        tl.store(Scales + row, scale)
        q = tl.clamp(y / scale, -fp8_max, fp8_max)
        tl.store(Out + row * stride_o + cols, q.to(Out.dtype.element_ty), mask=mask)
    else:
        tl.store(Out + row * stride_o + cols, (normed * w).to(Out.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    t = t.reshape(-1, n_cols)
    return t if t.stride(1) == 1 else t.contiguous()


def fused_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None, weight_offset: float | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without residual: the normed x. With residual: (norm(x + residual), x + residual).

    x, residual: [..., hidden]; weight: [hidden]. Outputs are new tensors of x's shape.
    weight_offset: the weight plus this scales the normed value in float32 (Gemma's 1, OLMo's
    0), the output in the sum's dtype; None: Llama's rounding.
    """
    out, _, residual_out = _launch(x, weight, eps, residual, None, weight_offset)
    return out if residual_out is None else (out, residual_out)


def fused_rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None, fp8_dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes [M, hidden] fp8_dtype, scales [M, 1] float32, x + residual or None): the norm's
    output, rounded to x's dtype, quantised per row as `per_token_quant` does. x 2-D."""
    assert x.dim() == 2 and weight.dtype == x.dtype
    assert residual is None or residual.dtype == x.dtype
    return _launch(x, weight, eps, residual, fp8_dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
            fp8_dtype: torch.dtype | None, weight_offset: float | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    n_cols = x.shape[-1]
    assert weight.shape == (n_cols,)
    x2d = _rows(x, n_cols)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = fp8_dtype or (sum_dtype if weight_offset is not None
                              else torch.promote_types(sum_dtype, weight.dtype))
    out = torch.empty(x2d.shape, dtype=out_dtype, device=x.device)
    scales = None
    if fp8_dtype is not None:
        scales = torch.empty(x2d.shape[0], 1, dtype=torch.float32, device=x.device)
    if residual is not None:
        r2d = _rows(residual, n_cols)
        residual_out = torch.empty(x2d.shape, dtype=sum_dtype, device=x.device)
    else:
        r2d = residual_out = x2d  # unused by the kernel
    block = triton.next_power_of_2(n_cols)
    num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    if x2d.shape[0] > 0:
        _rmsnorm_kernel[(x2d.shape[0],)](
            x2d, r2d, weight, out, residual_out, scales if scales is not None else x2d,
            x2d.stride(0), r2d.stride(0), out.stride(0), residual_out.stride(0), n_cols, eps,
            torch.finfo(fp8_dtype).max if fp8_dtype is not None else 0.0, MIN_SCALE,
            float(weight_offset or 0.0), HAS_RESIDUAL=residual is not None,
            QUANT=fp8_dtype is not None, BLOCK=block, FP32_WEIGHT=weight_offset is not None,
            num_warps=num_warps, **pdl_launch_args(x2d))
    out = out.view(x.shape)
    return out, scales, None if residual is None else residual_out.view(x.shape)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm (with the residual add in front, when given), in plain PyTorch."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)
