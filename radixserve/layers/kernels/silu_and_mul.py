"""SiLU-and-mul for a merged gate/up projection, in Triton: [T, 2I] -> silu(x[:, :I]) * x[:, I:].

Rounded like the PyTorch expression `F.silu(gate) * up`: silu is computed in float32 and rounded
to the input dtype before the product, which is computed in float32 and rounded again.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue


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
