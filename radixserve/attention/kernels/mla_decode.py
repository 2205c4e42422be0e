"""MLA decode attention (DeepSeek-V2 with weight absorption), split-KV, in Triton.

The pool holds one entry per token per layer: the compressed latent c (kv_lora_rank = 512
values for V2) followed by the rotated rope key (64). With the up-projections absorbed, every
query head attends over the same entries (MQA with one KV head):
  score(h, j) = q_latent[h] . c[j] + q_rope[h] . k_rope[j]     (q = [q_latent | q_rope], 576)
  out[h]      = sum_j softmax(score)[h, j] * c[j]              (512: the latent is the value)
so one tile load of c serves as key and value for BLOCK_H heads at once; that shared read is
what makes MLA decode cheap.

Stage 1 runs one program per (request, block of BLOCK_H heads, split) over the split plan of the
MHA decode kernel (decode_attention.py: splits aligned to BLOCK_N, shortened per request on the
device from seq_len, so CUDA graphs replay it for any lengths); stage 2 is that module's merge
kernel over [bs, H, S, kv_lora_rank] partial outputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.attention.kernels.decode_attention import (LOG2E, _decode_merge_kernel,
                                                           _split_len, dot_precision, is_fp8)
from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue


@triton.jit
def _mla_decode_split_kernel(
    Q, KV_Buffer, Req_to_token, Req_pool_indices, Seq_lens, Mid_out, Mid_lse, O,
    sm_scale_log2e, num_kv_splits, num_heads, kv_scale,
    stride_qb, stride_qh, stride_kvt, stride_req_row,
    stride_mid_b, stride_mid_h, stride_mid_s, stride_lse_b, stride_lse_h, stride_ob, stride_oh,
    LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, USE_PDL: tl.constexpr, KV_FP8: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    batch = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(Seq_lens + batch).to(tl.int32)
    split_len = _split_len(seq_len, num_kv_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_c = tl.arange(0, LATENT_DIM)
    offs_r = tl.arange(0, BLOCK_ROPE)
    r_mask = offs_r < ROPE_DIM
    if start < end:
        req_row = tl.load(Req_pool_indices + batch).to(tl.int64)
        q_base = Q + batch * stride_qb + heads[:, None] * stride_qh
        q_c = tl.load(q_base + offs_c[None, :], mask=head_mask[:, None], other=0.0)
        q_r = tl.load(q_base + LATENT_DIM + offs_r[None, :],
                      mask=head_mask[:, None] & r_mask[None, :], other=0.0)
        if not KV_FP8:
            q_c = q_c.to(KV_Buffer.dtype.element_ty)
            q_r = q_r.to(KV_Buffer.dtype.element_ty)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, LATENT_DIM], dtype=tl.float32)

        for block_start in range(start, end, BLOCK_N):
            pos = block_start + tl.arange(0, BLOCK_N)
            pos_mask = pos < end
            slots = tl.load(Req_to_token + req_row * stride_req_row + pos, mask=pos_mask,
                            other=0).to(tl.int64)
            row_ptr = KV_Buffer + slots[:, None] * stride_kvt
            c = tl.load(row_ptr + offs_c[None, :], mask=pos_mask[:, None], other=0.0)
            k_r = tl.load(row_ptr + LATENT_DIM + offs_r[None, :],
                          mask=pos_mask[:, None] & r_mask[None, :], other=0.0)
            if KV_FP8:  # FP8 codes x the layer's scale, in q's dtype
                c = (c.to(tl.float32) * kv_scale).to(q_c.dtype)
                k_r = (k_r.to(tl.float32) * kv_scale).to(q_c.dtype)
            qk = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
            qk += tl.dot(q_r, tl.trans(k_r), input_precision=DOT_PRECISION)
            qk = tl.where(pos_mask[None, :], qk * sm_scale_log2e, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
            m_i = m_new

        if SINGLE_SPLIT:
            tl.store(O + batch * stride_ob + heads[:, None] * stride_oh + offs_c[None, :],
                     (acc / l_i[:, None]).to(O.dtype.element_ty), mask=head_mask[:, None])
        else:
            tl.store(Mid_out + batch * stride_mid_b + heads[:, None] * stride_mid_h
                     + split * stride_mid_s + offs_c[None, :], acc / l_i[:, None],
                     mask=head_mask[:, None])
            tl.store(Mid_lse + batch * stride_lse_b + heads * stride_lse_h + split,
                     m_i + tl.log2(l_i), mask=head_mask)
    elif SINGLE_SPLIT:  # seq_len 0 (never scheduled): zeros, as the merge would give
        tl.store(O + batch * stride_ob + heads[:, None] * stride_oh + offs_c[None, :],
                 tl.zeros([BLOCK_H, LATENT_DIM], dtype=O.dtype.element_ty),
                 mask=head_mask[:, None])


def mla_decode_attention_fwd(q: torch.Tensor, kv_buffer: torch.Tensor, out: torch.Tensor,
                             req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                             seq_lens: torch.Tensor, mid_out: torch.Tensor,
                             mid_lse: torch.Tensor, sm_scale: float, latent_dim: int,
                             block_n: int = 32, block_h: int = 16, num_warps: int = 4,
                             num_stages: int = 2, kv_scale: float = 1.0) -> None:
    """q: [bs, H, latent_dim + rope_dim]; kv_buffer: [slots, 1, latent_dim + rope_dim] (one
    pool layer); out: [bs, H, latent_dim]. mid_out [bs, H, S, latent_dim] / mid_lse [bs, H, S]
    float32 workspaces, S = the most splits. latent_dim must be a power of two (512 for V2).
    An FP8 buffer holds entry / kv_scale (dequantised into q's dtype as it is loaded).
    No host sync, no allocation: safe to capture in a CUDA graph."""
    batch_size, num_heads, qk_dim = q.shape
    rope_dim = qk_dim - latent_dim
    assert latent_dim == triton.next_power_of_2(latent_dim), "latent dim must be a power of 2"
    assert kv_buffer.shape[-1] == qk_dim and kv_buffer.stride(-1) == 1 and q.stride(2) == 1
    num_kv_splits = mid_out.shape[2]
    single_split = num_kv_splits == 1
    grid = (batch_size, triton.cdiv(num_heads, block_h), num_kv_splits)
    _mla_decode_split_kernel[grid](
        q, kv_buffer, req_to_token, req_pool_indices, seq_lens, mid_out, mid_lse, out,
        sm_scale * LOG2E, num_kv_splits, num_heads, float(kv_scale),
        q.stride(0), q.stride(1), kv_buffer.stride(0), req_to_token.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        LATENT_DIM=latent_dim, ROPE_DIM=rope_dim,
        BLOCK_ROPE=max(16, triton.next_power_of_2(rope_dim)), BLOCK_H=block_h, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype), SINGLE_SPLIT=single_split,
        KV_FP8=is_fp8(kv_buffer.dtype),
        num_warps=num_warps, num_stages=num_stages, **pdl_launch_args(q),
    )
    if single_split:
        return
    _decode_merge_kernel[(batch_size, num_heads)](
        mid_out, mid_lse, out, seq_lens, seq_lens, num_kv_splits,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=latent_dim, BLOCK_D=latent_dim, SPLIT_ALIGN=block_n, SLIDING_WINDOW=-1,
        ATTN_CHUNK=0,
        # the latent output's next kernel is a torch product, not a GEMV
        HAS_SINKS=False, EARLY_LAUNCH=False,
        num_warps=4, num_stages=1, **pdl_launch_args(q),
    )


def mla_decode_reference(q: torch.Tensor, kv_buffer: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, sm_scale: float, latent_dim: int
                         ) -> torch.Tensor:
    """Plain PyTorch: each request's entries gathered, scores over [latent | rope], values the
    latent. Returns [bs, H, latent_dim] in float32."""
    outs = []
    for i in range(q.shape[0]):
        slots = req_to_token[req_pool_indices[i], :int(seq_lens[i])].long()
        entries = kv_buffer[slots, 0].float()  # [L, latent + rope]
        scores = (q[i].float() @ entries.t()) * sm_scale  # [H, L]
        outs.append(torch.softmax(scores, dim=-1) @ entries[:, :latent_dim])
    return torch.stack(outs)
