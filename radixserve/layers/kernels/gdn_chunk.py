"""The chunked gated delta rule of a Gated DeltaNet extend in two Triton launches.

Same contract as layers/gated_delta_rule.chunked (sequences padded to a multiple of C = 64
tokens, prepared q and k). With `log_decay` the cumulative sum of g inside each chunk:

1. `_chunk_prep_kernel`, one program per (sequence, chunk, value head), everything that does not
   depend on the state: A = strictly lower (beta_i k_i . k_j decayed from j to i), the inverse T
   of the unit lower-triangular I + A by forward substitution over its 64 rows in registers
   (repeated squaring, prod_j (I + (-A)^(2^j)) in six tensor-core products, lost all precision
   on near-identical keys), and from it u_free = T (beta v) and state_read = T (beta
   exp(log_decay) k), written chunk-major for the scan, with log_decay.
2. `_chunk_scan_kernel`, one program per (sequence, value head, block of value columns): its
   [key_dim, BLOCK_V] slice of the float32 state in registers across all chunks (the columns of
   the state evolve independently), per chunk
       u   = u_free - state_read @ S
       out = (q exp(log_decay)) @ S + (q k^T, decayed and causal) @ u
       S   = exp(chunk decay) S + (k decayed to the chunk's end)^T @ u
   with q and k read in their token-major layout and out written in it.

In torch the same took ~30 kernels a layer over [R, H, N, C, ...] float32 copies, a batched
triangular solve and a Python loop of seven kernels per chunk (an 8192-token prompt of
Qwen3-Next-80B's shapes on an H200: 3.7 ms of closed forms and 17.9 ms of loop per layer).
The scan's products run in TF32, as FLA's chunk kernels run theirs on bf16 operands, the prep's
in tf32x3 (off the serial path; A feeds an inversion); float32 models keep the torch path (IEEE
float32 products in the scan ran slower than its loop).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from radixserve.layers.gated_delta_rule import CHUNK


@triton.jit
def _chunk_prep_kernel(K, V, G, Beta, UFree, StateRead, LogDecay, length, heads, key_dim,
                       value_dim, C: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_DV: tl.constexpr):
    seq_chunk = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    chunks = length // C
    seq, chunk = seq_chunk // chunks, seq_chunk % chunks
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.arange(0, BLOCK_DV)
    mask_k, mask_v = offs_k[None, :] < key_dim, offs_v[None, :] < value_dim
    token = (seq * length + chunk * C + offs_c) * heads + head  # [C] (token, head) rows
    g = tl.load(G + token)
    beta = tl.load(Beta + token)
    k = tl.load(K + token[:, None] * key_dim + offs_k[None, :], mask=mask_k, other=0.0)
    v = tl.load(V + token[:, None] * value_dim + offs_v[None, :], mask=mask_v, other=0.0)
    log_decay = tl.cumsum(g, 0)
    below = offs_c[None, :] < offs_c[:, None]
    pair = tl.where(below, tl.exp(log_decay[:, None] - log_decay[None, :]), 0.0)
    k_beta = k * beta[:, None]
    # tf32x3 (three TF32 products, ~float32) off the serial path: A feeds an inversion
    neg = -tl.dot(k_beta, tl.trans(k), input_precision="tf32x3") * pair  # -A, strictly lower
    # T = (I + A)^-1 by forward substitution, row r = e_r - sum_{j < r} A_rj T_j (rows above
    # are final): stable where repeated squaring is not (near-identical keys in a chunk, e.g.
    # a run of one token, make A's powers grow like binomial coefficients before they cancel)
    rows = offs_c[:, None]
    inverse = (rows == offs_c[None, :]).to(tl.float32)
    for r in range(1, C):
        coeffs = tl.sum(tl.where(rows == r, neg, 0.0), 0)  # row r of -A, over columns j
        row_r = tl.sum(coeffs[:, None] * inverse, 0) + (offs_c == r).to(tl.float32)
        inverse = tl.where(rows == r, row_r[None, :], inverse)
    u_free = tl.dot(inverse, v * beta[:, None], input_precision="tf32x3")
    read = tl.dot(inverse, k_beta * tl.exp(log_decay)[:, None], input_precision="tf32x3")
    # chunk-major outputs: [R, H, N, C, ...]
    row = ((seq * heads + head) * chunks + chunk) * C + offs_c
    tl.store(UFree + row[:, None] * value_dim + offs_v[None, :], u_free, mask=mask_v)
    tl.store(StateRead + row[:, None] * key_dim + offs_k[None, :], read, mask=mask_k)
    tl.store(LogDecay + row, log_decay)


@triton.jit
def state_tile(State, seq_head, offs_r, offs_c, mask_r, mask_c, rows, cols):
    """Pointers and mask of one (sequence, head)'s [rows, cols] slice (a program's columns)
    of a contiguous [sequences * heads, rows, cols] float32 state: a chunk scan loads it
    first and stores it last."""
    ptrs = State + seq_head * rows * cols + offs_r[:, None] * cols + offs_c[None, :]
    return ptrs, mask_r[:, None] & mask_c[None, :]


def scan_columns(block_rows: int, width: int, programs: int, device: torch.device) -> int:
    """State columns per program of a chunk scan (programs: sequences x heads): 64, or 32
    past 128 state rows (registers) and where programs of 64 would leave SMs idle (one
    sequence of 32 heads on an H100: 1.56 against 1.75 ms at 8192 tokens); 16 at least."""
    block = max(16, min(64 if block_rows <= 128 else 32, triton.next_power_of_2(width)))
    if block == 64 and device.type == "cuda" and \
            programs * triton.cdiv(width, 64) < sm_count(device):
        block = 32
    return block


@triton.jit
def _chunk_scan_kernel(Q, K, UFree, StateRead, LogDecay, State, Out, length, heads, key_dim,
                       value_dim, C: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_V: tl.constexpr):
    seq_head = tl.program_id(0).to(tl.int64)
    seq, head = seq_head // heads, seq_head % heads
    chunks = length // C
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < key_dim, offs_v < value_dim
    state_ptrs, state_mask = state_tile(State, seq_head, offs_k, offs_v, mask_k, mask_v,
                                        key_dim, value_dim)
    state = tl.load(state_ptrs, mask=state_mask, other=0.0)
    causal = offs_c[None, :] <= offs_c[:, None]
    last = offs_c == C - 1
    for n in range(chunks):
        token = (seq * length + n * C + offs_c) * heads + head  # token-major rows
        row = (seq_head * chunks + n) * C + offs_c  # chunk-major rows
        log_decay = tl.load(LogDecay + row)
        read = tl.load(StateRead + row[:, None] * key_dim + offs_k[None, :],
                       mask=mask_k[None, :], other=0.0)
        u = tl.load(UFree + row[:, None] * value_dim + offs_v[None, :], mask=mask_v[None, :],
                    other=0.0) - tl.dot(read, state)
        q = tl.load(Q + token[:, None] * key_dim + offs_k[None, :], mask=mask_k[None, :],
                    other=0.0)
        k = tl.load(K + token[:, None] * key_dim + offs_k[None, :], mask=mask_k[None, :],
                    other=0.0)
        scores = tl.where(causal, tl.dot(q, tl.trans(k)) *
                          tl.exp(log_decay[:, None] - log_decay[None, :]), 0.0)
        out = tl.dot(q * tl.exp(log_decay)[:, None], state) + tl.dot(scores, u)
        tl.store(Out + token[:, None] * value_dim + offs_v[None, :], out, mask=mask_v[None, :])
        chunk_decay = tl.sum(tl.where(last, log_decay, 0.0), 0)
        k_end = k * tl.exp(chunk_decay - log_decay)[:, None]
        state = state * tl.exp(chunk_decay) + tl.dot(tl.trans(k_end), u)
    tl.store(state_ptrs, state, mask=state_mask)


def chunk_prep(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch 1 on float32 contiguous [R, L, H, ...] inputs: (u_free [rows, Dv], state_read
    [rows, Dk], log_decay [rows]), rows chunk-major (R, H, N, C)."""
    batch, length, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    chunks = length // CHUNK
    rows = batch * heads * chunks * CHUNK
    u_free = torch.empty(rows, value_dim, dtype=torch.float32, device=k.device)
    read = torch.empty(rows, key_dim, dtype=torch.float32, device=k.device)
    log_decay = torch.empty(rows, dtype=torch.float32, device=k.device)
    _chunk_prep_kernel[(batch * chunks, heads)](
        k, v, g, beta, u_free, read, log_decay, length, heads, key_dim, value_dim, C=CHUNK,
        BLOCK_K=max(16, triton.next_power_of_2(key_dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(value_dim)), num_warps=8, num_stages=1)
    return u_free, read, log_decay


def chunk_scan(q: torch.Tensor, k: torch.Tensor, prep: tuple[torch.Tensor, ...],
               state: torch.Tensor, block_v: int | None = None, stages: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch 2: (o [R, L, H, Dv] float32, the final state). block_v / stages: the launch's
    value columns per program and software-pipelining depth (benchmarks/gpu_gdn_chunk.py
    sweeps them; by default scan_columns')."""
    batch, length, heads, key_dim = k.shape
    value_dim = prep[0].shape[-1]
    block_k = max(16, triton.next_power_of_2(key_dim))
    if block_v is None:
        block_v = scan_columns(block_k, value_dim, batch * heads, k.device)
    state = state.float().contiguous().clone()
    out = torch.empty(batch, length, heads, value_dim, dtype=torch.float32, device=k.device)
    _chunk_scan_kernel[(batch * heads, triton.cdiv(value_dim, block_v))](
        q, k, *prep, state, out, length, heads, key_dim, value_dim, C=CHUNK,
        BLOCK_K=block_k, BLOCK_V=block_v, num_warps=4, num_stages=stages)
    return out, state


def chunked_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_delta_rule.chunked in two launches: q, k [R, L, H, Dk] (prepared), v [R, L, H,
    Dv], g, beta [R, L, H], state [R, H, Dk, Dv]; returns (o [R, L, H, Dv] float32, the final
    state)."""
    assert k.shape[1] % CHUNK == 0, "pad the sequences to a multiple of CHUNK"
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    return chunk_scan(q, k, chunk_prep(k, v, g, beta), state)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
