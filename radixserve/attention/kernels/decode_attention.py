"""Split-KV ("flash-decoding") attention for one new token per request, in Triton.

Stage 1 runs one program per (request, KV head, split). The query heads that share the KV head
(a GQA group) are processed together: K/V of the split are loaded once and multiplied with the
whole group with `tl.dot`, the group padded to at least 16 rows. Each program writes its
normalised partial output and log-sum-exp (base 2) to fixed workspaces. Stage 2 merges splits.

The query is the request's last token, at position p = seq_len - 1. It attends to the window
[first, seq_len): first = 0; with a sliding window of W > 0 keys (Hugging Face's
`kv_idx > q_idx - sliding_window`) first = max(0, seq_len - W), so the window holds
win_len = seq_len - first = min(seq_len, W) positions, the query's own among them; with
chunked attention of C > 0 positions (Llama-4's local layers: a key is seen only from its own
chunk, `kv_idx // C == q_idx // C`) first = (p // C) * C. `first_key` gives both.

Split plan, computed on the device from seq_len so a CUDA graph can replay it for any lengths:
  split_len = max(round_up(cdiv(win_len, num_kv_splits), SPLIT_ALIGN), SPLIT_ALIGN)
  split s covers positions [first + s * split_len, min(first + (s + 1) * split_len, seq_len));
  splits past cdiv(win_len, split_len) are empty, write nothing, and stage 2 never reads them.
So `num_kv_splits` is an upper bound chosen on the host (per batch size); short sequences (or
short windows: a long context with a window of W costs only W positions) use fewer splits by
themselves. Stage 2 derives the same number of used splits from seq_len and W. With one split
(large batches) stage 1 writes the final output itself and stage 2 is not launched.

Logit soft-capping (Gemma-2) with cap c > 0 turns each score s = (q . k) * sm_scale into
c * tanh(s / c) before the softmax. The kernels keep scores in base-2 units (times log2(e));
the cap is applied to the natural-unit score, so in base-2 units it is c * log2(e).

All three are compile-time switches (SLIDING_WINDOW <= 0, ATTN_CHUNK <= 0 and LOGIT_CAP <= 0
switch them off): the default kernels are the same code as without them, and a model compiles one
variant per distinct (window, chunk, cap) its layers use.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.core.triton_pdl import pdl_launch_args, pdl_launch_then_wait, pdl_prologue


@dataclass(frozen=True)
class DecodeKernelConfig:
    # 2 warps x 3 stages keeps more loads in flight per SM than 4 x 2: at batch 256-512 and
    # context 1536 on an H200 it reads KV at 4.21 TB/s (99% of copy bandwidth) against 3.87-4.08
    block_n: int = 64        # KV positions per inner step; also the split alignment
    num_warps: int = 2
    num_stages: int = 3
    early_v: bool = False    # load a block's V together with its K (before the scores): FP8
    # a cap on registers per thread (0: the compiler's choice), for more programs per SM: over
    # an FP8 pool the kernel takes 246 and fits 4 programs (8 warps) per SM on an H200
    max_registers: int = 0
    # keep a stale running max per row until some row's block max passes it by LAZY_MAX_BITS
    # (base 2): most blocks then skip the rescale of the accumulator (exp2 of the correction,
    # a multiply per accumulator element); probabilities reach at most 2^LAZY_MAX_BITS
    lazy_rescale: bool = False
    # gather each split's first block (all but this step's own position) before the PDL wait
    early_kv: bool = False

    @classmethod
    def from_spec(cls, spec: str) -> "DecodeKernelConfig":
        """The config spelled "block_n,num_warps,num_stages,early_v[,max_registers[,lazy
        [,early_kv]]]" (integers; absent fields keep their defaults), as
        RADIXSERVE_DECODE_CONFIG gives it."""
        values = [int(x) for x in spec.split(",")]
        block_n, warps, stages, early_v = values[:4]
        return cls(block_n, warps, stages, bool(early_v), values[4] if len(values) > 4 else 0,
                   *(bool(flag) for flag in values[5:7]))


LOG2E = 1.4426950408889634
# at batch 1 the merge lets o_proj launch while the split kernel runs, so o_proj's first weight
# tile, loaded ahead of its PDL wait, overlaps attention (H200, Llama-3.1-8B shapes: batch-1
# decode bf16 4.14 -> 4.12-4.13 and 4.12 -> 4.08-4.10 ms, FP8 2.80 -> 2.77-2.78 and 2.75-2.76 ->
# 2.73 ms; at batch 8 it lost 0.01-0.03 ms, so it stays off there);
# RADIXSERVE_MERGE_EARLY_LAUNCH=0: the usual wait-then-launch at every batch
MERGE_EARLY_LAUNCH = os.environ.get("RADIXSERVE_MERGE_EARLY_LAUNCH", "1") == "1"
# lazy_rescale's slack: p = 2^(score - stale max) stays <= 256, exact enough in fp16/bf16 (same
# relative precision as p <= 1) and far from overflow in the float32 sums
LAZY_MAX_BITS = 8.0


@triton.jit
def first_key(pos, SLIDING_WINDOW: tl.constexpr, ATTN_CHUNK: tl.constexpr):
    """The first key position a query at position `pos` sees (keys first..pos): pos - W + 1
    (at least 0) in a window of W, the start of its chunk of C positions, else 0."""
    first = pos * 0
    if SLIDING_WINDOW > 0:
        first = tl.maximum(pos - SLIDING_WINDOW + 1, 0)
    if ATTN_CHUNK > 0:
        first = pos // ATTN_CHUNK * ATTN_CHUNK
    return first


@triton.jit
def _window_len(seq_len, SLIDING_WINDOW: tl.constexpr, ATTN_CHUNK: tl.constexpr):
    """Positions the query (at seq_len - 1) attends to: seq_len - its first key."""
    win_len = seq_len
    if SLIDING_WINDOW > 0 or ATTN_CHUNK > 0:
        win_len = seq_len - first_key(seq_len - 1, SLIDING_WINDOW, ATTN_CHUNK)
    return win_len


@triton.jit
def _split_len(win_len, num_kv_splits, SPLIT_ALIGN: tl.constexpr):
    split_len = tl.cdiv(tl.cdiv(win_len, num_kv_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    return tl.maximum(split_len, SPLIT_ALIGN)


@triton.jit
def soft_cap_log2(qk, LOGIT_CAP: tl.constexpr):
    """c * tanh(s / c) for scores qk = s * log2(e) in base-2 units; the result is in base-2 units.

    tanh(x) = 1 - 2 / (exp(2x) + 1), which the Triton interpreter runs too (no libdevice). It
    never gives NaN: exp(2x) overflowing to inf gives 1, underflowing to 0 gives -1.
    """
    x = qk * (1.0 / (LOGIT_CAP * 1.4426950408889634))  # = s / c
    tanh = 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)
    return tanh * (LOGIT_CAP * 1.4426950408889634)


@triton.jit
def _gather_rows(Buffer, slots, stride_t, head_offset, offs_d, mask):
    """Rows `slots` of one head of a K or V buffer, masked lanes 0."""
    return tl.load(Buffer + slots[:, None] * stride_t + head_offset + offs_d[None, :],
                   mask=mask, other=0.0)


@triton.jit
def _attend_block(q, k, v, V_Buffer, slots, stride_vt, v_head_offset, offs_d, kv_mask,
                  pos_mask, m_i, l_i, acc, sm_scale_log2e, DOT_PRECISION: tl.constexpr,
                  LOGIT_CAP: tl.constexpr, KV_FP8: tl.constexpr, V_LOADED: tl.constexpr,
                  LAZY_RESCALE: tl.constexpr, LAZY_BITS: tl.constexpr):
    """One block of keys k (as loaded: FP8 codes or half precision) into the running max m_i,
    sum l_i and weighted values acc; its values are v (V_LOADED) or gathered here (rows
    `slots` of V_Buffer), after the scores."""
    if KV_FP8:
        k = k.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2e
    if LOGIT_CAP > 0:
        qk = soft_cap_log2(qk, LOGIT_CAP)
    qk = tl.where(pos_mask[None, :], qk, float("-inf"))
    # every block holds at least one valid position (all of [start, end) is in the
    # window), so the block's row maxima are finite
    m_block = tl.max(qk, 1)
    if LAZY_RESCALE:
        # one branch for the whole program: the first block (m_i = -inf) always takes it
        if tl.max(m_block - m_i, 0) > LAZY_BITS:
            m_new = tl.maximum(m_i, m_block)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p = tl.exp2(qk - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
    else:
        m_new = tl.maximum(m_i, m_block)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
    if not V_LOADED:
        v = _gather_rows(V_Buffer, slots, stride_vt, v_head_offset, offs_d, kv_mask)
    if KV_FP8:
        v = v.to(q.dtype)
    if LAZY_RESCALE:  # acc is on m_i's scale already
        acc = acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _decode_split_kernel(
    Q, K_Buffer, V_Buffer, Req_to_token, Req_pool_indices, Seq_lens, Mid_out, Mid_lse, O,
    Sinks, sm_scale_log2e, num_kv_splits, v_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_req_row,
    stride_mid_b, stride_mid_h, stride_mid_s, stride_lse_b, stride_lse_h, stride_ob, stride_oh,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, SLIDING_WINDOW: tl.constexpr, ATTN_CHUNK: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    USE_PDL: tl.constexpr, KV_FP8: tl.constexpr, FP8_AS_FP16: tl.constexpr,
    EARLY_V: tl.constexpr, LAZY_RESCALE: tl.constexpr, LAZY_BITS: tl.constexpr,
    EARLY_KV: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """FP8 KV: the codes are multiplied as they are (k_scale is folded into sm_scale_log2e by
    the caller, v_scale applied to the output), converted to fp16 (FP8_AS_FP16: exact, and one
    instruction per pair on Hopper) or to q's float32, so no per-element scaling runs.

    EARLY_KV: the split's first block is gathered before the PDL wait, all but this step's own
    position: under PDL only the kernel right before can still be running (the rope + KV store,
    which writes q and this step's K/V), and the step's inputs (seq_lens, req_pool_indices,
    the request table's rows) and the K/V of earlier positions were written before it. The new
    position's row is read after the wait."""
    if not EARLY_KV:
        pdl_prologue(USE_PDL)
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(Seq_lens + batch).to(tl.int32)
    win_len = _window_len(seq_len, SLIDING_WINDOW, ATTN_CHUNK)
    split_len = _split_len(win_len, num_kv_splits, BLOCK_N)
    start = split * split_len
    if SLIDING_WINDOW > 0 or ATTN_CHUNK > 0:  # the window's first position (else 0)
        start += seq_len - win_len
    end = tl.minimum(start + split_len, seq_len)
    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP_SIZE + offs_g
    head_mask = offs_g < GROUP_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if EARLY_KV:
        req_row = tl.load(Req_pool_indices + batch).to(tl.int64)
        pos0 = start + tl.arange(0, BLOCK_N)
        pos_mask0 = pos0 < end
        # every slot of the block, this step's own included (the table row was written before)
        slots0 = tl.load(Req_to_token + req_row * stride_req_row + pos0, mask=pos_mask0,
                         other=0).to(tl.int64)
        earlier0 = pos_mask0 & (pos0 < seq_len - 1)  # K/V stored by earlier steps
        mask0 = earlier0[:, None] & d_mask[None, :]
        k0 = _gather_rows(K_Buffer, slots0, stride_kt, kv_head * stride_kh, offs_d, mask0)
        v0 = _gather_rows(V_Buffer, slots0, stride_vt, kv_head * stride_vh, offs_d, mask0)
        pdl_prologue(USE_PDL)
    if start < end:
        if not EARLY_KV:
            req_row = tl.load(Req_pool_indices + batch).to(tl.int64)

        q = tl.load(Q + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=head_mask[:, None] & d_mask[None, :], other=0.0)
        if not KV_FP8:
            q = q.to(K_Buffer.dtype.element_ty)
        elif FP8_AS_FP16:
            q = q.to(tl.float16)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

        loop_start = start
        if EARLY_KV:  # the first block: this step's own position, if in it, joins now
            own_mask = (pos_mask0 & (pos0 >= seq_len - 1))[:, None] & d_mask[None, :]
            k_own = _gather_rows(K_Buffer, slots0, stride_kt, kv_head * stride_kh, offs_d,
                                 own_mask)
            v_own = _gather_rows(V_Buffer, slots0, stride_vt, kv_head * stride_vh, offs_d,
                                 own_mask)
            k0 = tl.where(own_mask, k_own, k0)
            v0 = tl.where(own_mask, v_own, v0)
            m_i, l_i, acc = _attend_block(q, k0, v0, V_Buffer, slots0, stride_vt,
                                          kv_head * stride_vh, offs_d,
                                          pos_mask0[:, None] & d_mask[None, :], pos_mask0,
                                          m_i, l_i, acc, sm_scale_log2e, DOT_PRECISION,
                                          LOGIT_CAP, KV_FP8, True, LAZY_RESCALE, LAZY_BITS)
            loop_start = start + BLOCK_N
        for block_start in range(loop_start, end, BLOCK_N):
            pos = block_start + tl.arange(0, BLOCK_N)
            pos_mask = pos < end
            slots = tl.load(Req_to_token + req_row * stride_req_row + pos, mask=pos_mask,
                            other=0).to(tl.int64)
            kv_mask = pos_mask[:, None] & d_mask[None, :]
            k = _gather_rows(K_Buffer, slots, stride_kt, kv_head * stride_kh, offs_d, kv_mask)
            v = k  # unused unless EARLY_V
            if EARLY_V:  # issue the V gather with K's: one memory round trip per block, not two
                v = _gather_rows(V_Buffer, slots, stride_vt, kv_head * stride_vh, offs_d,
                                 kv_mask)
            m_i, l_i, acc = _attend_block(q, k, v, V_Buffer, slots, stride_vt,
                                          kv_head * stride_vh, offs_d, kv_mask, pos_mask, m_i,
                                          l_i, acc, sm_scale_log2e, DOT_PRECISION, LOGIT_CAP,
                                          KV_FP8, EARLY_V, LAZY_RESCALE, LAZY_BITS)

        if KV_FP8:
            acc = acc * v_scale
        out_mask = head_mask[:, None] & d_mask[None, :]
        if SINGLE_SPLIT:  # the only split: this is the final output
            if HAS_SINKS:  # each head's sink logit joins the softmax's sum, with no value
                sink = tl.load(Sinks + heads, mask=head_mask, other=0.0).to(tl.float32)
                l_i = l_i + tl.exp2(sink * 1.4426950408889634 - m_i)
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
    Mid_out, Mid_lse, O, Seq_lens, Sinks, num_kv_splits,
    stride_mid_b, stride_mid_h, stride_mid_s, stride_lse_b, stride_lse_h, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_ALIGN: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, ATTN_CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_LAUNCH: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """EARLY_LAUNCH (batch 1): the next kernel (o_proj) may launch while the split kernel
    still runs (triton_pdl.pdl_launch_then_wait)."""
    if EARLY_LAUNCH:
        pdl_launch_then_wait(USE_PDL)
    else:
        pdl_prologue(USE_PDL)
    batch = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(Seq_lens + batch).to(tl.int32)
    win_len = _window_len(seq_len, SLIDING_WINDOW, ATTN_CHUNK)  # the split kernel's plan
    num_used_splits = tl.cdiv(win_len, _split_len(win_len, num_kv_splits, SPLIT_ALIGN))

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
    if HAS_SINKS:  # the head's sink logit joins the softmax's sum, with no value
        l_i = tl.where(l_i > 0, l_i + tl.exp2(tl.load(Sinks + head).to(tl.float32)
                                              * 1.4426950408889634 - m_i), l_i)
    out = tl.where(l_i > 0, acc / l_i, 0.0)  # seq_len 0 (never scheduled) gives zeros
    tl.store(O + batch * stride_ob + head * stride_oh + offs_d,
             out.to(O.dtype.element_ty), mask=d_mask)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def default_decode_config(kv_dtype: torch.dtype, num_kv_splits: int = 1) -> DecodeKernelConfig:
    """The config for a pool of this dtype at a batch cut into num_kv_splits splits per request.

    FP8 codes, V gathered with K (hides the conversions' latency: 2.93-3.04 TB/s against
    2.77-2.82 without, H200, batch 256-862, context 1536). At half of bf16's bytes per token the
    conversions and the two MMAs no longer hide under the loads; at the batches that run one
    split, many one-warp programs over 32-position tiles with five stages (each program with
    its own loads in flight) keep more of them going than fewer two-warp ones: context 1536,
    batch 862 766 us against 870-888, batch 256 239 against 267, batch 64 66 against 71
    (batch 128: 145 against 134; TritonAttnBackend cuts such middle batches in two and keeps
    this config, 122 us). Small batches split each request and have few programs: there two
    warps over 64-position tiles stay faster (batch 8: 15.3 us against 17.7).
    Half-precision pools read at copy bandwidth with the plain default at large batches; where
    requests split (batch 1-32) a stale running max (lazy_rescale) shortens each program's
    chain: context 1024, batch 8 13.8 against 14.4 us, batch 16 21.9 against 22.9 (decode steps
    5.20 against 5.24 ms at batch 8). Over FP8 pools it did not pay (batch 8 18.1 against
    15.5 us, batch 862 844 against 826)."""
    if not is_fp8(kv_dtype):
        return DecodeKernelConfig(lazy_rescale=num_kv_splits > 1)
    if num_kv_splits == 1:
        return DecodeKernelConfig(block_n=32, num_warps=1, num_stages=5, early_v=True)
    return DecodeKernelConfig(early_v=True)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs are multiplied in full precision (tests); tf32 would cost ~1e-3."""
    return "ieee" if dtype == torch.float32 else "tf32"


def normalize_window_and_cap(sliding_window: int | None, logit_cap: float | None,
                             attention_chunk: int | None = None) -> tuple[int, float, int]:
    """The kernels' compile-time (SLIDING_WINDOW, LOGIT_CAP, ATTN_CHUNK): every "off" value
    maps to one variant, -1, 0.0 and 0, so they compile no more kernels than needed."""
    window = int(sliding_window) if sliding_window is not None and sliding_window > 0 else -1
    cap = float(logit_cap) if logit_cap is not None and logit_cap > 0 else 0.0
    chunk = int(attention_chunk) if attention_chunk is not None and attention_chunk > 0 else 0
    if window > 0 and chunk > 0:
        raise ValueError("a layer has either a sliding window or attention chunks, not both")
    return window, cap, chunk


def decode_workspace_shapes(batch_size: int, num_heads: int, num_kv_splits: int,
                            head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of (mid_out, mid_lse), both float32."""
    return (batch_size, num_heads, num_kv_splits, head_dim), (batch_size, num_heads, num_kv_splits)


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         out: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         mid_out: torch.Tensor, mid_lse: torch.Tensor, sm_scale: float,
                         config: DecodeKernelConfig = DecodeKernelConfig(), *,
                         sliding_window: int = -1, logit_cap: float = 0.0,
                         k_scale: float = 1.0, v_scale: float = 1.0,
                         sinks: torch.Tensor | None = None, attention_chunk: int = 0) -> None:
    """Write attention of q ([bs, H, D]) over each request's first seq_len positions into out.

    k/v_buffer: [slots, Hkv, D] (one layer of the pool). mid_out [bs, H, S, D] and mid_lse
    [bs, H, S] are float32 workspaces; S (their third dim) is the maximum number of splits.
    sliding_window W > 0: attend only the last W positions (the query's own included).
    attention_chunk C > 0: attend only the positions of the query's chunk of C (p // C * C on).
    logit_cap c > 0: scores s become c * tanh(s / c). All three are compile-time constants;
    <= 0 is off.
    sinks [H] float32 (gpt-oss): each head's logit joins its softmax's sum with no value.
    FP8 buffers (float8_e4m3fn / e5m2) hold value / scale: the scores are scaled by k_scale and
    the output by v_scale (the codes themselves enter the products unscaled).
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
    kv_fp8 = is_fp8(k_buffer.dtype)
    sm_scale_log2e = sm_scale * LOG2E * (float(k_scale) if kv_fp8 else 1.0)
    window, cap, chunk = normalize_window_and_cap(sliding_window, logit_cap, attention_chunk)

    single_split = num_kv_splits == 1
    _decode_split_kernel[(batch_size, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_out, mid_lse, out,
        sinks if sinks is not None else seq_lens, sm_scale_log2e, num_kv_splits, float(v_scale),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        GROUP_SIZE=group_size, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group_size)), BLOCK_N=config.block_n,
        DOT_PRECISION=dot_precision(q.dtype), SINGLE_SPLIT=single_split,
        SLIDING_WINDOW=window, ATTN_CHUNK=chunk, LOGIT_CAP=cap, KV_FP8=kv_fp8,
        FP8_AS_FP16=q.dtype in (torch.float16, torch.bfloat16), EARLY_V=config.early_v,
        LAZY_RESCALE=config.lazy_rescale, LAZY_BITS=LAZY_MAX_BITS, EARLY_KV=config.early_kv,
        HAS_SINKS=sinks is not None, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_launch_args(q),
        **({"maxnreg": config.max_registers} if config.max_registers > 0 else {}),
    )
    if single_split:
        return
    _decode_merge_kernel[(batch_size, num_heads)](
        mid_out, mid_lse, out, seq_lens, sinks if sinks is not None else seq_lens,
        num_kv_splits, mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT_ALIGN=config.block_n, SLIDING_WINDOW=window,
        ATTN_CHUNK=chunk,
        EARLY_LAUNCH=MERGE_EARLY_LAUNCH and batch_size == 1, HAS_SINKS=sinks is not None,
        num_warps=4 if block_d >= 256 else 2, num_stages=1, **pdl_launch_args(q),
    )
