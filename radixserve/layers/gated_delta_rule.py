"""The gated delta rule and the causal convolution in front of it, in plain PyTorch.

The recurrence, per value head, with S a [key_dim, value_dim] state, for each token t:
    S <- exp(g_t) * S                          (gated decay, g_t <= 0)
    u_t = beta_t * (v_t - S^T k_t)             (delta rule: write only what S mispredicts)
    S <- S + k_t u_t^T
    o_t = S^T q_t
q and k are L2-normalised per head and q scaled by key_dim ** -0.5 before (`prepare_qk`).

`recurrent_step` runs one token per request (decode). `chunked` runs whole sequences in chunks
of CHUNK tokens: inside a chunk the recurrence is solved in closed form (a unit lower-triangular
system gives the chunk's u all at once, the WY form of DeltaNet), and only the chunk-to-chunk
state update is sequential. Sequences of different lengths are padded to a common number of
chunks with tokens of beta = 0, k = 0 and g = 0, which leave the state as it was.

All state arithmetic is float32, as transformers' reference (and FLA's kernels) keep it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

CHUNK = 64


def prepare_qk(q: torch.Tensor, k: torch.Tensor, group: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., key_heads, key_dim] -> float32 [..., value_heads, key_dim]: L2-normalised
    (eps 1e-6 inside the root), q scaled by key_dim ** -0.5, each key head repeated for the
    `group` consecutive value heads it serves."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if group > 1:
        q = q.repeat_interleave(group, dim=-2)
        k = k.repeat_interleave(group, dim=-2)
    return q, k


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request. q, k [B, H, Dk] (prepared), v [B, H, Dv], g, beta [B, H],
    state [B, H, Dk, Dv] float32. Returns (o [B, H, Dv] float32, the new state)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    update = (v.float() - predicted) * beta[..., None]
    state = state + k[..., :, None] * update[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


class ChunkTerms(NamedTuple):
    """What the chunk-to-chunk scan needs, each [R, H, N, C, ...] float32 (N chunks of C
    tokens): the chunk's u before the state's correction (`u_free`, [.., Dv]) and the matrix
    that maps the state into that correction (`state_read`, [.., Dk]), q decayed from the
    chunk's start (`q_decayed`, [.., Dk]), the causal decayed scores within the chunk
    (`scores`, [.., C]), k decayed to the chunk's end (`k_to_end`, [.., Dk]), and each
    chunk's whole log decay (`chunk_decay`, [R, H, N])."""
    u_free: torch.Tensor
    state_read: torch.Tensor
    q_decayed: torch.Tensor
    scores: torch.Tensor
    k_to_end: torch.Tensor
    chunk_decay: torch.Tensor


def by_chunk(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Padded sequences [R, L, H, ...] (L a multiple of CHUNK) -> float32 [R, H, N, C, ...]
    (N chunks of C = CHUNK tokens)."""
    batch, length, heads = tensors[0].shape[:3]
    assert length % CHUNK == 0, "pad the sequences to a multiple of CHUNK"
    out = []
    for x in tensors:
        x = x.float().transpose(1, 2)
        out.append(x.reshape(batch, heads, length // CHUNK, CHUNK, *x.shape[3:]))
    return out


def chunk_decays(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g [R, H, N, C] (log decays) -> (log decay from the chunk's start through token i [R, H,
    N, C], exp(log_decay_i - log_decay_j) for j <= i and zero above the diagonal [.., C, C])."""
    log_decay = g.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=g.device).tril()
    pair_decay = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(
        ~causal, float("-inf")).exp()
    return log_decay, pair_decay


def chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> ChunkTerms:
    """Every chunk's closed form at once (no sequential dependence). Shapes as `chunked`."""
    q, k, v, g, beta = by_chunk(q, k, v, g, beta)
    log_decay, pair_decay = chunk_decays(g)
    k_beta = k * beta[..., None]
    # (I + A) u = beta v - beta exp(log_decay) K S0, A strictly lower: A_ij = beta_i k_i.k_j
    # decayed from j to i; solved once for both right-hand sides
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    rhs = torch.cat([v * beta[..., None], k_beta * log_decay.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_free, state_read = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * pair_decay  # within the chunk, j <= i
    chunk_decay = log_decay[..., -1]  # [R, H, N]
    return ChunkTerms(u_free, state_read, q * log_decay.exp()[..., None], scores,
                      k * (chunk_decay[..., None] - log_decay).exp()[..., None], chunk_decay)


def scan_chunks(terms: ChunkTerms, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential part, chunk after chunk: (out [R, H, N, C, Dv], the final state)."""
    out = torch.empty_like(terms.u_free)
    state = state.float()
    for n in range(terms.u_free.shape[2]):
        u = terms.u_free[:, :, n] - terms.state_read[:, :, n] @ state
        out[:, :, n] = terms.q_decayed[:, :, n] @ state + terms.scores[:, :, n] @ u
        state = state * terms.chunk_decay[:, :, n].exp()[..., None, None] + \
            terms.k_to_end[:, :, n].transpose(-1, -2) @ u
    return out, state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole sequences, padded to a multiple of CHUNK. q, k [R, L, H, Dk] (prepared), v
    [R, L, H, Dv], g, beta [R, L, H] (zero past each sequence's end, as k and v), state
    [R, H, Dk, Dv] float32 (the state before the first token). Returns (o [R, L, H, Dv]
    float32, the state after the last token). On the GPU, kernels/gdn_chunk.chunked_triton."""
    batch, length, heads, _ = k.shape
    out, state = scan_chunks(chunk_terms(q, k, v, g, beta), state)
    return out.reshape(batch, heads, length, -1).transpose(1, 2), state


def conv_extend(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution of padded sequences, then SiLU. x [R, L, C], conv_state
    [R, W, C] (the W = kernel - 1 inputs before x; zeros for a sequence from position 0),
    weight [C, W + 1], bias [C] or None. Returns (SiLU(conv) [R, L, C], the whole input [R,
    W + L, C], from which the caller reads each sequence's new state at its own end)."""
    full = torch.cat([conv_state.to(x.dtype), x], dim=1)
    out = F.conv1d(full.transpose(1, 2).to(weight.dtype), weight[:, None, :], bias,
                   groups=weight.shape[0])
    return F.silu(out).transpose(1, 2).to(x.dtype), full


def conv_step(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: x [B, C], conv_state [B, W, C]. Returns (SiLU(conv) [B, C],
    the new state [B, W, C])."""
    window = torch.cat([conv_state.to(x.dtype), x[:, None, :]], dim=1)
    out = F.conv1d(window.transpose(1, 2).to(weight.dtype), weight[:, None, :], bias,
                   groups=weight.shape[0])
    return F.silu(out[..., 0]).to(x.dtype), window[:, 1:]
