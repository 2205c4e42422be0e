"""A Mamba-2 extend's chunked SSD scan in one Triton launch (layers/mamba2_mixer.py).

Same contract as the layer's torch form (layers/ssd_rule.ssd_chunked plus the D term):
sequences padded to a multiple of C = 64 tokens, read straight from the conv's padded output
(x | B | C, token-major, zero past each end) and the step sizes dt (float32, zero past each
end). One program per (sequence, head, block of head_dim columns) keeps its [state, BLOCK_P]
slice of the float32 state in registers across all chunks (the columns evolve independently)
and, with L the cumulative sum of g = dt A inside the chunk, per chunk:
    y = (C exp(L)) @ S + (C B^T, decayed from j to i, j <= i) @ (dt x) + D x
    S = exp(L_last) S + (B decayed to the chunk's end)^T @ (dt x)
B and C of the head's group are read where the conv wrote them. The products run in TF32, as
the Gated DeltaNet's chunk scan (kernels/gdn_chunk.py); float32 models keep the torch form.
The torch form runs ~25 kernels a layer over [R, H, N, C, ...] float32 copies, with its
products in float32 on the CUDA cores (Nemotron-3-Nano's 8192-token prefill on an H100: ~140
of its 321 ms).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.gated_delta_rule import CHUNK
from radixserve.layers.kernels.gdn_chunk import scan_columns, state_tile


@triton.jit
def _ssd_scan_kernel(Conv, Dt, ALog, D, State, Out, length, heads, channels, inner,
                     groups_width, HEAD_DIM: tl.constexpr, STATE: tl.constexpr,
                     HEADS_PER_GROUP: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_P: tl.constexpr):
    seq_head = tl.program_id(0).to(tl.int64)
    seq, head = seq_head // heads, seq_head % heads
    group = head // HEADS_PER_GROUP
    chunks = length // C
    offs_c = tl.arange(0, C)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_n, mask_p = offs_n < STATE, offs_p < HEAD_DIM
    state_ptrs, state_mask = state_tile(State, seq_head, offs_n, offs_p, mask_n, mask_p, STATE,
                                        HEAD_DIM)
    state = tl.load(state_ptrs, mask=state_mask, other=0.0)
    a = -tl.exp(tl.load(ALog + head).to(tl.float32))
    d = tl.load(D + head).to(tl.float32)
    causal = offs_c[None, :] <= offs_c[:, None]
    last = offs_c == C - 1
    for n in range(chunks):
        token = seq * length + n * C + offs_c  # [C] rows of the padded batch
        dt = tl.load(Dt + token * heads + head)
        log_decay = tl.cumsum(dt * a, 0)
        x = tl.load(Conv + token[:, None] * channels + head * HEAD_DIM + offs_p[None, :],
                    mask=mask_p[None, :], other=0.0).to(tl.float32)
        b = tl.load(Conv + token[:, None] * channels + inner + group * STATE + offs_n[None, :],
                    mask=mask_n[None, :], other=0.0).to(tl.float32)
        c = tl.load(Conv + token[:, None] * channels + inner + groups_width + group * STATE +
                    offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
        v = x * dt[:, None]
        scores = tl.where(causal, tl.dot(c, tl.trans(b)) *
                          tl.exp(log_decay[:, None] - log_decay[None, :]), 0.0)
        out = tl.dot(c * tl.exp(log_decay)[:, None], state) + tl.dot(scores, v) + d * x
        tl.store(Out + (token[:, None] * heads + head) * HEAD_DIM + offs_p[None, :], out,
                 mask=mask_p[None, :])
        chunk_decay = tl.sum(tl.where(last, log_decay, 0.0), 0)
        b_end = b * tl.exp(chunk_decay - log_decay)[:, None]
        state = state * tl.exp(chunk_decay) + tl.dot(tl.trans(b_end), v)
    tl.store(state_ptrs, state, mask=state_mask)


def ssd_chunked_triton(conv_out: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor,
                       d: torch.Tensor, state: torch.Tensor, heads: int, head_dim: int,
                       groups: int, state_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """conv_out [R, L, heads * head_dim + 2 * groups * state] (x | B | C, padded: L a
    multiple of CHUNK, zero past each end), dt [R, L, heads] float32 (zero past each end),
    state [R, heads, state, head_dim] (before the first token). Returns (y [R, L, heads,
    head_dim] float32 with D's term, the state after the last token)."""
    batch, length, channels = conv_out.shape
    assert length % CHUNK == 0, "pad the sequences to a multiple of CHUNK"
    conv_out, dt = conv_out.contiguous(), dt.float().contiguous()
    state = state.float().contiguous().clone()
    out = torch.empty(batch, length, heads, head_dim, dtype=torch.float32,
                      device=conv_out.device)
    block_n = max(16, triton.next_power_of_2(state_size))
    # as the delta rule's scan (Falcon-H1's state of 256: 32 columns)
    block_p = scan_columns(block_n, head_dim, batch * heads, conv_out.device)
    _ssd_scan_kernel[(batch * heads, triton.cdiv(head_dim, block_p))](
        conv_out, dt, a_log, d, state, out, length, heads, channels, heads * head_dim,
        groups * state_size, HEAD_DIM=head_dim, STATE=state_size,
        HEADS_PER_GROUP=heads // groups, C=CHUNK, BLOCK_N=block_n, BLOCK_P=block_p,
        num_warps=4 if block_n <= 128 else 8, num_stages=1)
    return out, state

