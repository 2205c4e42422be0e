"""One decode step of a Gated DeltaNet layer in two Triton launches (layers/gated_delta_net.py).

Per request, from the in-projections' outputs (the conv's q | k | v inputs, a, b):
  1. `_conv_step_kernel` (request, channel block): the causal conv over the row's last inputs
     and the token's, SiLU, rounded to the activations' dtype; the row's inputs shifted by one
     in place (each channel read and written by one program);
  2. `_rule_step_kernel` (request, value head, value block): L2 norms of its key head's q and k
     (q scaled by key_dim ** -0.5), g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b),
     the gated delta rule on a [key_dim, BLOCK_V] tile of the row's float32 state, written back
     in place, and o = S^T q for the block.
The torch path runs ~35 kernels for this (gathers, the conv, the norms, the rule's products,
index_put writes back), which at a few microseconds each dominate a hybrid model's decode
step. Rows come from the requests' `req_pool_idx` (padded requests: the padding row), read from
a device tensor, so both launches replay inside a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(Mixed, ConvW, ConvBias, ConvState, Rows, ConvOut, channels, stride_m,
                      stride_sr, stride_sw, stride_o, WIDTH: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < channels
    row = tl.load(Rows + token).to(tl.int64)
    x = tl.load(Mixed + token * stride_m + offs, mask=mask, other=0.0)
    acc = x.to(tl.float32) * \
        tl.load(ConvW + offs * (WIDTH + 1) + WIDTH, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:  # Mamba-2's conv (kernels/ssd_decode.py)
        acc += tl.load(ConvBias + offs, mask=mask, other=0.0).to(tl.float32)
    base = ConvState + row * stride_sr
    for j in tl.static_range(WIDTH):
        prev = tl.load(base + j * stride_sw + offs, mask=mask, other=0.0)
        acc += prev.to(tl.float32) * \
            tl.load(ConvW + offs * (WIDTH + 1) + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(base + (j - 1) * stride_sw + offs, prev, mask=mask)
    tl.store(base + (WIDTH - 1) * stride_sw + offs, x.to(ConvState.dtype.element_ty),
             mask=mask)
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(ConvOut + token * stride_o + offs, out.to(ConvOut.dtype.element_ty), mask=mask)


@triton.jit
def _rule_step_kernel(Conv, A, B, ALog, DtBias, Ssm, Rows, Out, stride_c, stride_a,
                      stride_ssm_r, stride_ssm_h, stride_o, key_channels, beta_scale,
                      KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = tl.load(Rows + token).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < KEY_DIM
    conv = Conv + token * stride_c
    key_head = head // GROUP
    q = tl.load(conv + key_head * KEY_DIM + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(conv + key_channels + key_head * KEY_DIM + offs_k, mask=mask_k,
                other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * (1.0 / tl.sqrt(KEY_DIM * 1.0))
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < VALUE_DIM
    v = tl.load(conv + 2 * key_channels + head * VALUE_DIM + offs_v, mask=mask_v,
                other=0.0).to(tl.float32)
    a = tl.load(A + token * stride_a + head).to(tl.float32)
    b = tl.load(B + token * stride_a + head).to(tl.float32)
    x = a + tl.load(DtBias + head).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    decay = tl.exp(-tl.exp(tl.load(ALog + head).to(tl.float32)) * softplus)
    # sigmoid(b) rounded to b's dtype, as the torch path computes it, then scaled
    beta = (1.0 / (1.0 + tl.exp(-b))).to(B.dtype.element_ty).to(tl.float32) * beta_scale
    state_ptr = Ssm + row * stride_ssm_r + head * stride_ssm_h + \
        offs_k[:, None] * VALUE_DIM + offs_v[None, :]
    tile_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_ptr, mask=tile_mask, other=0.0) * decay
    predicted = tl.sum(state * k[:, None], 0)
    state += k[:, None] * ((v - predicted) * beta)[None, :]
    tl.store(state_ptr, state, mask=tile_mask)
    out = tl.sum(state * q[:, None], 0)
    tl.store(Out + token * stride_o + head * VALUE_DIM + offs_v, out, mask=mask_v)


def gdn_decode(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor, conv_weight: torch.Tensor, conv_states: torch.Tensor,
               ssm_states: torch.Tensor, rows: torch.Tensor, num_k_heads: int, key_dim: int,
               value_dim: int, beta_scale: float = 1.0) -> torch.Tensor:
    """mixed [B, 2 * keys + values] (the conv's inputs), a, b [B, Hv] (rows may be strided),
    conv_weight [C, W + 1], conv_states [R, W, C], ssm_states [R, Hv, key_dim, value_dim]
    float32 (both updated in place at `rows` [B]). Returns o [B, Hv, value_dim] float32."""
    batch, num_v_heads = a.shape[0], a.shape[1]
    out = torch.empty(batch, num_v_heads, value_dim, dtype=torch.float32, device=mixed.device)
    if batch == 0:
        return out
    assert mixed.stride(1) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    assert a.stride(0) == b.stride(0), "a and b as two views of one b|a product"
    assert conv_states.stride(2) == 1 and ssm_states.is_contiguous()
    conv = conv_step_triton(mixed, conv_weight, None, conv_states, rows)
    block_v = min(triton.next_power_of_2(value_dim), 32)
    _rule_step_kernel[(batch, num_v_heads, triton.cdiv(value_dim, block_v))](
        conv, a, b, a_log, dt_bias, ssm_states, rows, out, conv.stride(0), a.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), out.stride(0), num_k_heads * key_dim,
        float(beta_scale), KEY_DIM=key_dim, VALUE_DIM=value_dim,
        GROUP=num_v_heads // num_k_heads,
        BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v, num_warps=4)
    return out


def conv_step_triton(mixed: torch.Tensor, conv_weight: torch.Tensor,
                     conv_bias: torch.Tensor | None, conv_states: torch.Tensor,
                     rows: torch.Tensor) -> torch.Tensor:
    """SiLU(conv) [B, C] of one token per request over its row's inputs, which shift by one in
    place (conv_states [R, W, C] at `rows`)."""
    batch, channels = mixed.shape
    conv = torch.empty(batch, channels, dtype=mixed.dtype, device=mixed.device)
    block_c = 256
    _conv_step_kernel[(batch, triton.cdiv(channels, block_c))](
        mixed, conv_weight, conv_weight if conv_bias is None else conv_bias, conv_states, rows,
        conv, channels, mixed.stride(0), conv_states.stride(0), conv_states.stride(1),
        conv.stride(0), WIDTH=conv_states.shape[1], HAS_BIAS=conv_bias is not None,
        BLOCK_C=block_c, num_warps=4)
    return conv
