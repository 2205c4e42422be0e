"""A recurrent mixer's extend: the causal depthwise conv + SiLU in one Triton launch.

Reads each sequence's tokens where the pass holds them (packed, one after another, as the
in-projection wrote them) and the kernel - 1 inputs before them from its state row (zeros for a
sequence from position 0), and writes the output already padded for the chunked rule: [R,
padded length, channels], zero past each sequence's end (where the rule needs k = v = 0). The
torch form (gated_delta_rule.conv_extend and the layer's packing) gathers, pads, concatenates
and transposes around F.conv1d: ~10 kernels, and cuDNN's depthwise kernel took 0.7 ms a layer
for an 8192-token prompt of Qwen3-Next-80B's shapes on an H200.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_extend_kernel(Mixed, Weight, Bias, ConvState, Rows, Starts, Lens, Continues, Out,
                        channels, padded_len, stride_m, stride_sr, stride_sw,
                        WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < channels
    start = tl.load(Starts + seq).to(tl.int64)
    length = tl.load(Lens + seq)
    continues = tl.load(Continues + seq)  # 1: the row's inputs come before, 0: zeros
    state = ConvState + tl.load(Rows + seq).to(tl.int64) * stride_sr
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(WIDTH + 1):  # tap j reads the input at t - WIDTH + j
        pos = offs_t - WIDTH + j
        in_seq = (pos >= 0) & (pos < length)
        x = tl.load(Mixed + (start + pos)[:, None] * stride_m + offs_c[None, :],
                    mask=in_seq[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        before = (pos < 0) & (pos + WIDTH * continues >= 0)
        x += tl.load(state + (WIDTH + pos)[:, None] * stride_sw + offs_c[None, :],
                     mask=before[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        weight = tl.load(Weight + offs_c * (WIDTH + 1) + j, mask=mask_c, other=0.0)
        acc += x * weight.to(tl.float32)[None, :]
    out = acc * tl.sigmoid(acc)
    out = tl.where((offs_t < length)[:, None], out, 0.0)
    tl.store(Out + (seq * padded_len + offs_t)[:, None] * channels + offs_c[None, :],
             out.to(Out.dtype.element_ty), mask=(offs_t < padded_len)[:, None] & mask_c[None, :])


def conv_extend_padded(mixed: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                       rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                       continues: torch.Tensor, padded_len: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """mixed [tokens, channels] (row stride free), weight [channels, W + 1] (and a bias
    [channels]: Mamba-2's conv), conv_states
    [rows, W, channels]; per sequence its state row, first token in `mixed`, length, and
    whether it continues its row's inputs (else zeros). Returns SiLU(conv) [R, padded_len,
    channels] in mixed's dtype, zero past each length. conv_states is only read."""
    channels = mixed.shape[1]
    count = rows.shape[0]
    width = weight.shape[1] - 1
    assert mixed.stride(1) == 1 and conv_states.stride(2) == 1
    out = torch.empty(count, padded_len, channels, dtype=mixed.dtype, device=mixed.device)
    block_t, block_c = 32, 128
    grid = (count, triton.cdiv(padded_len, block_t), triton.cdiv(channels, block_c))
    _conv_extend_kernel[grid](mixed, weight, weight if bias is None else bias, conv_states,
                              rows, starts, lens,
                              continues.to(torch.int32), out,
                              channels, padded_len, mixed.stride(0), conv_states.stride(0),
                              conv_states.stride(1), WIDTH=width,
                              HAS_BIAS=bias is not None, BLOCK_T=block_t,
                              BLOCK_C=block_c, num_warps=4)
    return out


def conv_states_after(mixed: torch.Tensor, conv_states: torch.Tensor, rows: torch.Tensor,
                      starts: torch.Tensor, lens: torch.Tensor, continues: torch.Tensor
                      ) -> torch.Tensor:
    """Each sequence's new conv state [R, W, channels]: its last W inputs, reaching back into
    its row's old inputs (or zeros) when it is shorter than W. Plain torch on R x W rows."""
    width = conv_states.shape[1]
    pos = lens[:, None] - width + torch.arange(width, device=mixed.device)  # [R, W]
    from_x = mixed[(starts[:, None] + pos.clamp(min=0)).flatten()].unflatten(0, pos.shape)
    old = torch.where(continues[:, None, None], conv_states[rows], 0)
    from_old = old.gather(1, (width + pos).clamp(0, width - 1)[..., None].expand(
        -1, -1, old.shape[-1]))
    return torch.where((pos >= 0)[..., None], from_x.to(old.dtype), from_old)
