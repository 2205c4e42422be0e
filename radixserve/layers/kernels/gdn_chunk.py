"""The chunk-to-chunk scan of the chunked gated delta rule in one Triton launch.

layers/gated_delta_rule.chunk_terms solves every chunk's closed form at once; what is left is
sequential: for each chunk n, with S the [key_dim, value_dim] float32 state before it,
    u   = u_free[n] - state_read[n] @ S
    out = q_decayed[n] @ S + scores[n] @ u
    S   = exp(chunk_decay[n]) * S + k_to_end[n]^T @ u
The torch loop (`gated_delta_rule.scan_chunks`) launches seven kernels per chunk and layer: for
an 8192-token prompt, 128 chunks, about 900 launches a layer. Here one program per (sequence,
value head, block of value columns) keeps its [key_dim, BLOCK_V] slice of S in registers and
walks all chunks (the columns of S evolve independently: every product above is linear in S's
columns). Four tensor-core products a chunk; float32 models take them in IEEE float32 (greedy
identical to the reference), others in TF32, as FLA's chunk kernels run on bf16 operands.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.gated_delta_rule import ChunkTerms


@triton.jit
def _chunk_scan_kernel(UFree, StateRead, QDecayed, Scores, KToEnd, ChunkDecay, State, Out,
                       num_chunks, key_dim, value_dim,
                       C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                       PRECISION: tl.constexpr):
    seq_head = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < key_dim, offs_v < value_dim
    state_ptrs = State + seq_head * key_dim * value_dim + offs_k[:, None] * value_dim + \
        offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_ptrs, mask=state_mask, other=0.0)
    # [C, key_dim] tiles (state_read, q_decayed, k_to_end) and [C, value_dim] tiles of chunk n
    k_tile = seq_head * num_chunks * C * key_dim + offs_c[:, None] * key_dim + offs_k[None, :]
    v_tile = seq_head * num_chunks * C * value_dim + offs_c[:, None] * value_dim + \
        offs_v[None, :]
    c_tile = seq_head * num_chunks * C * C + offs_c[:, None] * C + offs_c[None, :]
    k_mask, v_mask = mask_k[None, :], mask_v[None, :]
    for n in range(num_chunks):
        read = tl.load(StateRead + k_tile + n * C * key_dim, mask=k_mask, other=0.0)
        u = tl.load(UFree + v_tile + n * C * value_dim, mask=v_mask, other=0.0) - \
            tl.dot(read, state, input_precision=PRECISION)
        q = tl.load(QDecayed + k_tile + n * C * key_dim, mask=k_mask, other=0.0)
        scores = tl.load(Scores + c_tile + n * C * C)
        out = tl.dot(q, state, input_precision=PRECISION) + \
            tl.dot(scores, u, input_precision=PRECISION)
        tl.store(Out + v_tile + n * C * value_dim, out, mask=v_mask)
        k_end = tl.load(KToEnd + k_tile + n * C * key_dim, mask=k_mask, other=0.0)
        decay = tl.exp(tl.load(ChunkDecay + seq_head * num_chunks + n))
        state = state * decay + tl.dot(tl.trans(k_end), u, input_precision=PRECISION)
    tl.store(state_ptrs, state, mask=state_mask)


def scan_chunks_triton(terms: ChunkTerms, state: torch.Tensor, precise: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as gated_delta_rule.scan_chunks: (out [R, H, N, C, Dv], the final state
    [R, H, Dk, Dv]) float32. precise: IEEE float32 products (float32 models), else TF32."""
    batch, heads, chunks, chunk, value_dim = terms.u_free.shape
    key_dim = terms.state_read.shape[-1]
    parts = [t.contiguous() for t in terms]
    state = state.float().contiguous().clone()
    out = torch.empty_like(parts[0])
    block_k = max(16, triton.next_power_of_2(key_dim))
    block_v = max(16, min(64 if block_k <= 128 else 32, triton.next_power_of_2(value_dim)))
    grid = (batch * heads, triton.cdiv(value_dim, block_v))
    _chunk_scan_kernel[grid](*parts, state, out, chunks, key_dim, value_dim, C=chunk,
                             BLOCK_K=block_k, BLOCK_V=block_v,
                             PRECISION="ieee" if precise else "tf32", num_warps=4)
    return out, state
