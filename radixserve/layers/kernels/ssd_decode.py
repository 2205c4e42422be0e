"""One decode step of a Mamba-2 mixer in two Triton launches (layers/mamba2_mixer.py).

Per request, from the in-projection's x | B | C and the step sizes dt (softplus'd and clamped
by the layer, float32):
  1. gdn_decode's conv step with the conv's bias: SiLU(conv) over the row's last inputs and the
     token's, the row's inputs shifted by one in place;
  2. `_ssd_step_kernel` (request, head, head_dim block): S <- exp(dt A) S + B (dt x)^T on a
     [state_size, BLOCK_P] tile of the row's float32 state, written back in place, and y =
     S^T C + D x for the block, B and C of the head's group.
The torch path runs ~20 kernels for this (the conv's concatenation and gather, group repeats,
the state's products, index_put writes back). Rows come from the requests' `req_pool_idx` (a
device tensor), so both launches replay inside a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.kernels.gdn_decode import conv_step_triton


@triton.jit
def _ssd_step_kernel(Conv, Dt, ALog, D, Ssm, Rows, Out, stride_c, stride_dt, stride_ssm_r,
                     stride_ssm_h, stride_o, inner, groups_width,
                     STATE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_PER_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_P: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = tl.load(Rows + token).to(tl.int64)
    conv = Conv + token * stride_c
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < STATE
    group = head // HEADS_PER_GROUP
    b = tl.load(conv + inner + group * STATE + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    c = tl.load(conv + inner + groups_width + group * STATE + offs_n, mask=mask_n,
                other=0.0).to(tl.float32)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < HEAD_DIM
    x = tl.load(conv + head * HEAD_DIM + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    dt = tl.load(Dt + token * stride_dt + head)
    decay = tl.exp(-tl.exp(tl.load(ALog + head).to(tl.float32)) * dt)
    state_ptr = Ssm + row * stride_ssm_r + head * stride_ssm_h + \
        offs_n[:, None] * HEAD_DIM + offs_p[None, :]
    tile_mask = mask_n[:, None] & mask_p[None, :]
    state = tl.load(state_ptr, mask=tile_mask, other=0.0) * decay + \
        b[:, None] * (x * dt)[None, :]
    tl.store(state_ptr, state, mask=tile_mask)
    out = tl.sum(state * c[:, None], 0) + tl.load(D + head).to(tl.float32) * x
    tl.store(Out + token * stride_o + head * HEAD_DIM + offs_p, out, mask=mask_p)


def ssd_decode(mixed: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, d: torch.Tensor,
               conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
               conv_states: torch.Tensor, ssm_states: torch.Tensor, rows: torch.Tensor,
               groups: int, state_size: int, head_dim: int) -> torch.Tensor:
    """mixed [B, heads * head_dim + 2 * groups * state] (the conv's x | B | C inputs, rows may
    be strided), dt [B, heads] float32, conv_weight [C, W + 1], conv_bias [C] or None,
    conv_states [R, W, C], ssm_states [R, heads, state, head_dim] float32 (both updated in
    place at `rows` [B]). Returns y [B, heads, head_dim] float32, D's term included."""
    batch, heads = dt.shape
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32, device=mixed.device)
    if batch == 0:
        return out
    assert mixed.stride(1) == 1 and dt.stride(1) == 1
    assert conv_states.stride(2) == 1 and ssm_states.is_contiguous()
    conv = conv_step_triton(mixed, conv_weight, conv_bias, conv_states, rows)
    block_p = min(triton.next_power_of_2(head_dim), 32)
    _ssd_step_kernel[(batch, heads, triton.cdiv(head_dim, block_p))](
        conv, dt, a_log, d, ssm_states, rows, out, conv.stride(0), dt.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), out.stride(0), heads * head_dim,
        groups * state_size, STATE=state_size, HEAD_DIM=head_dim,
        HEADS_PER_GROUP=heads // groups, BLOCK_N=triton.next_power_of_2(state_size),
        BLOCK_P=block_p, num_warps=4)
    return out
