"""Mamba-2's selective state space recurrence (SSD), in plain PyTorch.

Per head, with S a [state_size, head_dim] state and for each token t (dt_t > 0 after softplus, A
< 0 per head, B_t and C_t of the head's group):
    S <- exp(dt_t * A) * S + B_t (dt_t x_t)^T
    y_t = S^T C_t + D * x_t
This is linear attention with a scalar decay per token: q = C, k = B, v = dt * x, log decay g =
dt * A. `ssd_step` runs one token per request (decode); `ssd_chunked` runs whole sequences in
chunks of CHUNK tokens: the outputs within a chunk in closed form (a causal decayed score
matrix), each chunk's contribution to the state, and the state at every chunk's start as one
product of those with a lower-triangular matrix of decays between chunks (no loop: the decay
is a scalar per head and token, so the chunk-to-chunk recurrence is linear). Padded tokens (k
= v = 0, g = 0) leave the state as it was. All state arithmetic is float32.
"""
from __future__ import annotations

import torch

from radixserve.layers.gated_delta_rule import CHUNK, by_chunk, chunk_decays


def ssd_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request. q, k [B, H, N], v [B, H, P], g [B, H] (float32), state [B, H,
    N, P] float32. Returns (y [B, H, P] float32 without the D term, the new state)."""
    state = state * g.exp()[..., None, None] + k.float()[..., :, None] * v.float()[..., None, :]
    return torch.einsum("bhn,bhnp->bhp", q.float(), state), state


def ssd_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole sequences, padded to a multiple of CHUNK. q, k [R, L, H, N], v [R, L, H, P], g [R,
    L, H] (zero past each sequence's end, as k and v), state [R, H, N, P] float32 (before the
    first token). Returns (y [R, L, H, P] float32 without the D term, the state after the last
    token)."""
    batch, length, heads, _ = k.shape
    q, k, v, g = by_chunk(q, k, v, g)
    log_decay, pair_decay = chunk_decays(g)
    within = ((q @ k.transpose(-1, -2)) * pair_decay) @ v  # [R, H, N, C, P]
    chunk_decay = log_decay[..., -1]  # [R, H, N]
    # each chunk's own writes, decayed to its end: [R, H, N, Dk, P]
    written = (k * (chunk_decay[..., None] - log_decay).exp()[..., None]).transpose(-1, -2) @ v
    # the states at each chunk's start and after the last one, all at once: start n sums the
    # writes of chunks m < n decayed over chunks m + 1 .. n - 1, and the first state decayed
    # over chunks 0 .. n - 1 (a lower-triangular [N + 1, N] matrix of decays per head)
    chunks = length // CHUNK
    through = chunk_decay.cumsum(-1)  # decay over chunks 0 .. n
    before = torch.cat([torch.zeros_like(through[..., :1]), through], dim=-1)  # 0 .. n - 1
    earlier = torch.ones(chunks + 1, chunks, dtype=torch.bool, device=q.device).tril(-1)
    decays = (before[..., :, None] - through[..., None, :]).masked_fill(
        ~earlier, float("-inf")).exp()  # [R, H, N + 1, N]
    states = (decays @ written.flatten(-2)).unflatten(-1, written.shape[-2:]) + \
        before.exp()[..., None, None] * state.float()[:, :, None]
    out = within + (q * log_decay.exp()[..., None]) @ states[:, :, :-1]
    return out.reshape(batch, heads, length, -1).transpose(1, 2), states[:, :, -1]
