"""Gated RMSNorms in one Triton launch per layer instead of ~10 torch kernels.

`gated_rmsnorm`: after a Gated DeltaNet's rule (layers/gated_delta_net.GatedRMSNorm): per
value head, the rule's output rounded to the activations' dtype, RMS-normed in float32, rounded
again, times the weight (rounded, as torch's half-precision product is), times SiLU(gate) in
float32, rounded. Each rounding is the module's own, so the two paths agree to the last bit
but for the order of the mean's sum.
`group_gated_rmsnorm`: a Mamba-2 mixer's (layers/mamba2_mixer.GroupedGatedRMSNorm), per group
of channels, gated before or after the norm, rounded as the module rounds."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_rmsnorm_kernel(X, Gate, Weight, Out, heads, stride_x, stride_g, stride_o, eps,
                          DIM: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < DIM
    dtype = Out.dtype.element_ty
    x = tl.load(X + token * stride_x + head * DIM + offs, mask=mask, other=0.0)
    x = x.to(dtype).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / DIM + eps)
    weight = tl.load(Weight + offs, mask=mask, other=0.0)
    scaled = (normed.to(dtype).to(tl.float32) * weight.to(tl.float32)).to(dtype)
    gate = tl.load(Gate + token * stride_g + head * DIM + offs, mask=mask, other=0.0)
    gate = gate.to(tl.float32)
    out = scaled.to(tl.float32) * (gate / (1.0 + tl.exp(-gate)))
    tl.store(Out + token * stride_o + head * DIM + offs, out.to(dtype), mask=mask)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """x [T, H, D] (float32, the rule's output), gate [T, H * D] (rows may be strided),
    weight [D] -> [T, H * D] of `dtype`."""
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads * dim, dtype=dtype, device=x.device)
    if tokens == 0:
        return out
    assert x.stride(2) == 1 and x.stride(1) == dim and gate.stride(1) == 1
    _gated_rmsnorm_kernel[(tokens, heads)](
        x, gate, weight, out, heads, x.stride(0), gate.stride(0), out.stride(0), float(eps),
        DIM=dim, BLOCK=triton.next_power_of_2(dim), num_warps=1 if dim <= 128 else 4)
    return out


@triton.jit
def _group_gated_rmsnorm_kernel(Y, Z, Weight, Out, stride_y, stride_z, stride_o, eps,
                                GROUP: tl.constexpr, BLOCK: tl.constexpr,
                                NORM_FIRST: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * GROUP + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < GROUP
    dtype = Out.dtype.element_ty
    y = tl.load(Y + token * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + token * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
    silu = z / (1.0 + tl.exp(-z))
    h = y if NORM_FIRST else y * silu
    h = h * tl.rsqrt(tl.sum(h * h, 0) / GROUP + eps)
    weight = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM_FIRST:  # Falcon-H1: weight * norm(y) * SiLU(z), rounded once
        out = weight * h * silu
    else:  # Mamba-2: the normed values rounded, then times the weight (rounded product)
        out = h.to(dtype).to(tl.float32) * weight
    tl.store(Out + token * stride_o + offs, out.to(dtype), mask=mask)


def group_gated_rmsnorm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                        group: int, norm_first: bool) -> torch.Tensor:
    """Mamba-2's gated norm (layers/mamba2_mixer.GroupedGatedRMSNorm) over whole groups of
    `group` channels: y, z [T, W] (rows may be strided; W a multiple of group), weight [W] ->
    [T, W] of y's dtype. norm_first: weight * norm(y) * SiLU(z) (Falcon-H1), else weight *
    norm(y * SiLU(z))."""
    tokens, width = y.shape
    out = torch.empty(tokens, width, dtype=y.dtype, device=y.device)
    if tokens == 0:
        return out
    assert y.stride(1) == 1 and z.stride(1) == 1 and width % group == 0
    _group_gated_rmsnorm_kernel[(tokens, width // group)](
        y, z, weight, out, y.stride(0), z.stride(0), out.stride(0), float(eps), GROUP=group,
        BLOCK=triton.next_power_of_2(group), NORM_FIRST=norm_first,
        num_warps=1 if group <= 256 else 4 if group <= 2048 else 8 if group <= 4096 else 16)
    return out
