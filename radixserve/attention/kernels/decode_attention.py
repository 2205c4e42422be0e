"""Split-KV ("flash-decoding") attention for one new token per request, in Triton.

Stage 1 runs one program per (request, KV head, split). The query heads that share the KV head
(a GQA group) are processed together: K/V of the split are loaded once and multiplied with the
whole group with `tl.dot`, the group padded to at least 16 rows. Each program writes its
normalised partial output and log-sum-exp (base 2) to fixed workspaces. Stage 2 merges splits.

Split plan, computed on the device from seq_len so a CUDA graph can replay it for any lengths:
  split_len = max(round_up(cdiv(seq_len, num_kv_splits), SPLIT_ALIGN), SPLIT_ALIGN)
  split s covers positions [s * split_len, min((s + 1) * split_len, seq_len)); splits past
  cdiv(seq_len, split_len) are empty, write nothing, and stage 2 never reads them.
So `num_kv_splits` is an upper bound chosen on the host (per batch size); short sequences use
fewer splits by themselves. With one split (large batches) stage 1 writes the final output
itself and stage 2 is not launched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.layers.kernels.pdl import pdl_launch_args, pdl_prologue


@dataclass(frozen=True)
class DecodeKernelConfig:
    # 2 warps x 3 stages keeps more loads in flight per SM than 4 x 2: at batch 256-512 and
    # context 1536 on an H200 it reads KV at 4.21 TB/s (99% of copy bandwidth) against 3.87-4.08
    block_n: int = 64        # KV positions per inner step; also the split alignment
    num_warps: int = 2
    num_stages: int = 3


@triton.jit
def _split_len(seq_len, num_kv_splits, SPLIT_ALIGN: tl.constexpr):
    split_len = tl.cdiv(tl.cdiv(seq_len, num_kv_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    return tl.maximum(split_len, SPLIT_ALIGN)


@triton.jit
def _decode_split_kernel(
    Q, K_Buffer, V_Buffer, Req_to_token, Req_pool_indices, Seq_lens, Mid_out, Mid_lse, O,
    sm_scale_log2e, num_kv_splits,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_req_row,
    stride_mid_b, stride_mid_h, stride_mid_s, stride_lse_b, stride_lse_h, stride_ob, stride_oh,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(Seq_lens + batch).to(tl.int32)
    split_len = _split_len(seq_len, num_kv_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP_SIZE + offs_g
    head_mask = offs_g < GROUP_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if start < end:
        req_row = tl.load(Req_pool_indices + batch).to(tl.int64)

        q = tl.load(Q + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=head_mask[:, None] & d_mask[None, :], other=0.0)
        q = q.to(K_Buffer.dtype.element_ty)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

        for block_start in range(start, end, BLOCK_N):
            pos = block_start + tl.arange(0, BLOCK_N)
            pos_mask = pos < end
            slots = tl.load(Req_to_token + req_row * stride_req_row + pos, mask=pos_mask,
                            other=0).to(tl.int64)
            kv_mask = pos_mask[:, None] & d_mask[None, :]
            k = tl.load(K_Buffer + slots[:, None] * stride_kt + kv_head * stride_kh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2e
            qk = tl.where(pos_mask[None, :], qk, float("-inf"))
            # every block holds at least one valid position, so m_new is finite
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_Buffer + slots[:, None] * stride_vt + kv_head * stride_vh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out_mask = head_mask[:, None] & d_mask[None, :]
        if SINGLE_SPLIT:  # the only split: this is the final output
            tl.store(O + batch * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     (acc / l_i[:, None]).to(O.dtype.element_ty), mask=out_mask)
        else:
            out_ptrs = (Mid_out + batch * stride_mid_b + heads[:, None] * stride_mid_h
                        + split * stride_mid_s + offs_d[None, :])
            tl.store(out_ptrs, acc / l_i[:, None], mask=out_mask)
            tl.store(Mid_lse + batch * stride_lse_b + heads * stride_lse_h + split,
                     m_i + tl.log2(l_i), mask=head_mask)
    elif SINGLE_SPLIT:  # seq_len 0 (never scheduled): zeros, as the merge would give
        tl.store(O + batch * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 tl.zeros([BLOCK_H, BLOCK_D], dtype=O.dtype.element_ty),
                 mask=head_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_merge_kernel(
    Mid_out, Mid_lse, O, Seq_lens, num_kv_splits,
    stride_mid_b, stride_mid_h, stride_mid_s, stride_lse_b, stride_lse_h, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_ALIGN: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    batch = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(Seq_lens + batch).to(tl.int32)
    num_used_splits = tl.cdiv(seq_len, _split_len(seq_len, num_kv_splits, SPLIT_ALIGN))

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(0, num_used_splits):
        lse = tl.load(Mid_lse + batch * stride_lse_b + head * stride_lse_h + split)
        part = tl.load(Mid_out + batch * stride_mid_b + head * stride_mid_h
                       + split * stride_mid_s + offs_d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha + weight * part
        l_i = l_i * alpha + weight
        m_i = m_new
    out = tl.where(l_i > 0, acc / l_i, 0.0)  # seq_len 0 (never scheduled) gives zeros
    tl.store(O + batch * stride_ob + head * stride_oh + offs_d,
             out.to(O.dtype.element_ty), mask=d_mask)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs are multiplied in full precision (tests); tf32 would cost ~1e-3."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_workspace_shapes(batch_size: int, num_heads: int, num_kv_splits: int,
                            head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of (mid_out, mid_lse), both float32."""
    return (batch_size, num_heads, num_kv_splits, head_dim), (batch_size, num_heads, num_kv_splits)


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         out: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         mid_out: torch.Tensor, mid_lse: torch.Tensor, sm_scale: float,
                         config: DecodeKernelConfig = DecodeKernelConfig()) -> None:
    """Write attention of q ([bs, H, D]) over each request's first seq_len positions into out.

    k/v_buffer: [slots, Hkv, D] (one layer of the pool). mid_out [bs, H, S, D] and mid_lse
    [bs, H, S] are float32 workspaces; S (their third dim) is the maximum number of splits.
    No host sync, no allocation: safe to capture in a CUDA graph.
    """
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    assert out.stride(2) == 1 and mid_out.stride(3) == 1
    num_kv_splits = mid_out.shape[2]
    group_size = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    sm_scale_log2e = sm_scale * 1.4426950408889634

    single_split = num_kv_splits == 1
    _decode_split_kernel[(batch_size, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_out, mid_lse, out,
        sm_scale_log2e, num_kv_splits,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        GROUP_SIZE=group_size, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group_size)), BLOCK_N=config.block_n,
        DOT_PRECISION=dot_precision(k_buffer.dtype), SINGLE_SPLIT=single_split,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch_args(q),
    )
    if single_split:
        return
    _decode_merge_kernel[(batch_size, num_heads)](
        mid_out, mid_lse, out, seq_lens, num_kv_splits,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT_ALIGN=config.block_n,
        num_warps=4 if block_d >= 256 else 2, num_stages=1, **pdl_launch_args(q),
    )
