"""Prefill-on-a-prefix ("extend") attention over a ragged batch, in Triton.

One program per (query head, request, block of BLOCK_M new tokens). It makes two passes with
one online softmax:
  1. the cached prefix, positions 0..prefix_len-1, gathered from the KV pool through
     req_to_token[req_pool_indices[i], pos] (no causal mask: every prefix token precedes every
     new token);
  2. this pass's new tokens, read from the contiguous k/v of the pass, causally. Blocks of keys
     wholly before the query block need no mask; only the diagonal blocks are masked.
Programs whose query block starts past the request's extend length exit at once. The query-block
axis is the slowest grid axis and runs in reverse, so the blocks with the most causal work (the
last ones of every request) start first and the tail does not straggle.

Sliding window of W > 0 keys (Hugging Face's `kv_idx > q_idx - sliding_window`): new token i is
at absolute position p = prefix_len + i and attends only keys at p - W < j <= p, in the prefix
and among the new tokens alike. A query block needs no key before its first query's window, so
both passes start at the block of keys holding position (first position - W + 1), rounded down
to BLOCK_N: whole blocks before it are skipped, and a long context costs only the window. The
window's boundary is masked inside blocks: in the prefix pass (masked anyway), in pass 2a's
blocks that start before the window of the block's last query (the later ones lie in every
query's window and stay unmasked) and in the diagonal blocks. A row can find no key of its
window in a block and none before it, so with a window the online softmax subtracts 0 instead of
a running max of -inf (no NaN); every real row sees at least itself, so its sum ends positive.

Logit soft-capping with cap c > 0 (Gemma-2): each score s = (q . k) * sm_scale becomes
c * tanh(s / c) before the softmax, applied to the natural-unit score before the conversion to
base-2 units (see decode_attention.soft_cap_log2).

Chunked attention of C > 0 positions (Llama-4's local layers, `kv_idx // C == q_idx // C`):
the token at position p attends only keys (p // C) * C <= j <= p. Like a window, the first key a
query sees (`decode_attention.first_key`) never decreases along the block, so the same skipping
and masking serve both.

A causal limit per new token (Gemma-3's images, whose tokens see their whole image): new token
i attends the new tokens j <= limit[i] (limit[i] >= i) instead of j <= i, the window still
counted from i. The diagonal pass then runs on to the block holding the query block's largest
limit, masked.

All are compile-time switches (SLIDING_WINDOW <= 0, ATTN_CHUNK <= 0, LOGIT_CAP <= 0, HAS_LIMIT
false: off);
the default kernel is the same code as without them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.attention.kernels.decode_attention import (LOG2E, dot_precision, first_key,
                                                           is_fp8, normalize_window_and_cap,
                                                           soft_cap_log2)


@dataclass(frozen=True)
class ExtendKernelConfig:
    block_m: int = 64    # new tokens (query rows) per program; a multiple of block_n
    block_n: int = 64    # keys per inner step
    num_warps: int = 4
    num_stages: int = 3


def default_extend_config(head_dim: int) -> ExtendKernelConfig:
    """Block sizes for a GPU run (Hopper-class shared memory).

    On an H200 (triton 3.6, bf16, head_dim 128, GQA 32/8) 64x64 with 4 warps and 3 stages and
    128x64 with 8 warps and 3 stages were the best of those tried (benchmarks/gpu_kernels.py
    --sweep), within 3% of each other; 64-row blocks waste less on short extends.
    """
    if head_dim <= 128:
        return ExtendKernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    return ExtendKernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


@triton.jit
def _online_softmax_step(q, k, v, m_i, l_i, acc, mask, sm_scale_log2e,
                         APPLY_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         LOGIT_CAP: tl.constexpr, EMPTY_ROWS: tl.constexpr,
                         v_scale=1.0, V_SCALED: tl.constexpr = False):
    """Fold one block of keys into (m_i, l_i, acc). Scores are kept in base-2 units.

    EMPTY_ROWS: a row may have had no valid key yet, in this block or before (sliding window).
    V_SCALED: v holds FP8 codes; their weighted sum is multiplied by v_scale (and the caller
    folded k_scale into sm_scale_log2e)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2e
    if LOGIT_CAP > 0:
        qk = soft_cap_log2(qk, LOGIT_CAP)
    if APPLY_MASK:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if EMPTY_ROWS:
        # m_new is -inf for a row with no valid key so far: subtract 0 instead, so that
        # alpha = p = 0 (not NaN) and the row stays empty (m_i -inf, l_i 0, acc 0)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(qk - m_sub[:, None])
    else:
        # each row has seen at least one valid key by now (pos 0 is in the first block it
        # visits), so m_new is finite and no row computes -inf - -inf
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    if V_SCALED:
        pv = pv * v_scale
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    Q, K_Extend, V_Extend, O, K_Buffer, V_Buffer, Req_to_token, Req_pool_indices,
    Extend_start_loc, Extend_seq_lens, Extend_prefix_lens, Sinks, Causal_limit,
    sm_scale_log2e, k_scale,
    v_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_ket, stride_keh, stride_vet,
    stride_veh,
    stride_kbt, stride_kbh, stride_vbt, stride_vbh, stride_req_row,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, ATTN_CHUNK: tl.constexpr, LOGIT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_AS_FP16: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
):
    head = tl.program_id(0)
    req = tl.program_id(1)
    block_m = tl.num_programs(2) - 1 - tl.program_id(2)  # heaviest (last) query blocks first
    kv_head = head // GROUP_SIZE

    ext_len = tl.load(Extend_seq_lens + req).to(tl.int32)
    block_start = block_m * BLOCK_M
    if block_start < ext_len:
        start_loc = tl.load(Extend_start_loc + req).to(tl.int64)
        prefix_len = tl.load(Extend_prefix_lens + req).to(tl.int32)
        req_row = tl.load(Req_pool_indices + req).to(tl.int64)

        offs_m = block_start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < ext_len
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM

        q = tl.load(Q + (start_loc + offs_m[:, None]) * stride_qt + head * stride_qh
                    + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        q = q.to(K_Extend.dtype.element_ty)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # a window or chunks: each query sees keys from first_key(its position) on
        WINDOWED: tl.constexpr = SLIDING_WINDOW > 0 or ATTN_CHUNK > 0
        # the first key of each query, relative to the new tokens (prefix: negative)
        first_m = first_key(prefix_len + offs_m, SLIDING_WINDOW, ATTN_CHUNK) - prefix_len

        # 1. cached prefix, through the pool. FP8 codes enter the products unscaled (fp16, or
        # q's float32): k_scale folds into the score scale, v_scale into the weighted sum
        q_prefix = q
        prefix_scale_log2e = sm_scale_log2e
        if KV_FP8:
            prefix_scale_log2e = sm_scale_log2e * k_scale
            if FP8_AS_FP16:
                q_prefix = q.to(tl.float16)
        prefix_start = 0
        if WINDOWED:  # skip the blocks before the window of the block's first query
            prefix_start = (first_key(prefix_len + block_start, SLIDING_WINDOW, ATTN_CHUNK)
                            // BLOCK_N * BLOCK_N)
        for n_start in range(prefix_start, prefix_len, BLOCK_N):
            pos = n_start + offs_n
            pos_mask = pos < prefix_len
            slots = tl.load(Req_to_token + req_row * stride_req_row + pos, mask=pos_mask,
                            other=0).to(tl.int64)
            kv_mask = pos_mask[:, None] & d_mask[None, :]
            k = tl.load(K_Buffer + slots[:, None] * stride_kbt + kv_head * stride_kbh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V_Buffer + slots[:, None] * stride_vbt + kv_head * stride_vbh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            if KV_FP8:
                k = k.to(q_prefix.dtype)
                v = v.to(q_prefix.dtype)
            mask = pos_mask[None, :]
            if WINDOWED:  # key j >= the query's first key
                mask = mask & (pos[None, :] - prefix_len >= first_m[:, None])
            m_i, l_i, acc = _online_softmax_step(q_prefix, k, v, m_i, l_i, acc, mask,
                                                 prefix_scale_log2e, True, DOT_PRECISION,
                                                 LOGIT_CAP, WINDOWED, v_scale, KV_FP8)

        # 2a. new tokens wholly before this query block (block_start < ext_len): no causal mask
        ke_base = K_Extend + kv_head * stride_keh + offs_d[None, :]
        ve_base = V_Extend + kv_head * stride_veh + offs_d[None, :]
        unmasked_start = 0
        if WINDOWED:
            # blocks before the first query's window are skipped; those before the last
            # query's window (its first key) need the window mask, the rest none
            last_query = tl.minimum(block_start + BLOCK_M, ext_len) - 1
            window_start = tl.maximum(
                first_key(prefix_len + block_start, SLIDING_WINDOW, ATTN_CHUNK) - prefix_len,
                0) // BLOCK_N * BLOCK_N
            last_first = first_key(prefix_len + last_query, SLIDING_WINDOW, ATTN_CHUNK) \
                - prefix_len
            unmasked_start = tl.minimum(
                tl.cdiv(tl.maximum(last_first, 0), BLOCK_N) * BLOCK_N, block_start)
            for n_start in range(window_start, unmasked_start, BLOCK_N):
                pos = n_start + offs_n
                rows = start_loc + pos[:, None]
                k = tl.load(ke_base + rows * stride_ket, mask=d_mask[None, :], other=0.0)
                v = tl.load(ve_base + rows * stride_vet, mask=d_mask[None, :], other=0.0)
                in_window = pos[None, :] >= first_m[:, None]
                m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, in_window,
                                                     sm_scale_log2e, True, DOT_PRECISION,
                                                     LOGIT_CAP, True)
        for n_start in range(unmasked_start, block_start, BLOCK_N):
            rows = start_loc + n_start + offs_n[:, None]
            k = tl.load(ke_base + rows * stride_ket, mask=d_mask[None, :], other=0.0)
            v = tl.load(ve_base + rows * stride_vet, mask=d_mask[None, :], other=0.0)
            m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, m_mask[:, None],
                                                 sm_scale_log2e, False, DOT_PRECISION,
                                                 LOGIT_CAP, False)

        # 2b. diagonal blocks, causal (and windowed); with limits, on to the last limit's block
        block_end = tl.minimum(block_start + BLOCK_M, ext_len)
        if HAS_LIMIT:  # padding rows: every key (finite softmax; never stored)
            limit = tl.load(Causal_limit + start_loc + offs_m, mask=m_mask,
                            other=1 << 30).to(tl.int32)
            block_end = tl.maximum(block_end,
                                   tl.minimum(tl.max(tl.where(m_mask, limit, 0), 0) + 1,
                                              ext_len))
        for n_start in range(block_start, block_end, BLOCK_N):
            pos = n_start + offs_n
            pos_mask = pos < ext_len
            rows = start_loc + pos[:, None]
            kv_mask = pos_mask[:, None] & d_mask[None, :]
            k = tl.load(ke_base + rows * stride_ket, mask=kv_mask, other=0.0)
            v = tl.load(ve_base + rows * stride_vet, mask=kv_mask, other=0.0)
            if HAS_LIMIT:
                causal = (limit[:, None] >= pos[None, :]) & pos_mask[None, :]
            else:
                causal = (offs_m[:, None] >= pos[None, :]) & pos_mask[None, :]
            if WINDOWED:
                causal = causal & (pos[None, :] >= first_m[:, None])
            m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, causal,
                                                 sm_scale_log2e, True, DOT_PRECISION,
                                                 LOGIT_CAP, WINDOWED)

        if HAS_SINKS:  # the head's sink logit joins the softmax's sum, with no value
            l_i += tl.exp2(tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634 - m_i)
        if WINDOWED:  # padding rows past ext_len may have seen no key (not stored anyway)
            l_i = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_i[:, None]
        tl.store(O + (start_loc + offs_m[:, None]) * stride_ot + head * stride_oh
                 + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=m_mask[:, None] & d_mask[None, :])


def extend_attention_fwd(q: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                         out: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         extend_start_loc: torch.Tensor, extend_seq_lens: torch.Tensor,
                         extend_prefix_lens: torch.Tensor, max_extend_len: int,
                         sm_scale: float, config: ExtendKernelConfig | None = None, *,
                         sliding_window: int = -1, logit_cap: float = 0.0,
                         k_scale: float = 1.0, v_scale: float = 1.0,
                         sinks: torch.Tensor | None = None,
                         causal_limit: torch.Tensor | None = None,
                         attention_chunk: int = 0) -> None:
    """Write extend attention into out ([T, H, D]).

    q: [T, H, D]; k/v_extend: [T, Hkv, D], this pass's new tokens packed request after request
    (request i's start at extend_start_loc[i]); k/v_buffer: [slots, Hkv, D] (one pool layer)
    holding each request's prefix. max_extend_len is a host int (>= every extend_seq_len) that
    sizes the grid, so no host sync is needed.
    sliding_window W > 0: the token at position p attends only keys p - W < j <= p.
    attention_chunk C > 0: the token at position p attends only keys (p // C) * C <= j <= p.
    logit_cap c > 0: scores s become c * tanh(s / c). All three are compile-time constants;
    <= 0 is off.
    sinks [H] float32 (gpt-oss): each head's logit joins its softmax's sum with no value.
    causal_limit [T] int32 (Gemma-3's images): new token i attends new tokens j <= limit[i]
    (an index into its request's new tokens, >= i) instead of j <= i.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_extend.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    for t in (q, k_extend, v_extend, out, k_buffer, v_buffer):
        assert t.stride(2) == 1, "the head_dim axis must be contiguous"
    config = config or default_extend_config(head_dim)
    assert config.block_m % config.block_n == 0, "block_m must be a multiple of block_n"
    batch_size = extend_seq_lens.shape[0]
    if num_tokens == 0 or batch_size == 0:
        return
    window, cap, chunk = normalize_window_and_cap(sliding_window, logit_cap, attention_chunk)
    grid = (num_heads, batch_size, triton.cdiv(max_extend_len, config.block_m))
    _extend_kernel[grid](
        q, k_extend, v_extend, out, k_buffer, v_buffer, req_to_token, req_pool_indices,
        extend_start_loc, extend_seq_lens, extend_prefix_lens,
        sinks if sinks is not None else extend_seq_lens,
        causal_limit if causal_limit is not None else extend_seq_lens, sm_scale * LOG2E,
        float(k_scale), float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_extend.stride(0), k_extend.stride(1), v_extend.stride(0), v_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP_SIZE=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        DOT_PRECISION=dot_precision(k_extend.dtype), SLIDING_WINDOW=window, ATTN_CHUNK=chunk,
        LOGIT_CAP=cap, KV_FP8=is_fp8(k_buffer.dtype),
        FP8_AS_FP16=q.dtype in (torch.float16, torch.bfloat16),
        HAS_SINKS=sinks is not None, HAS_LIMIT=causal_limit is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
