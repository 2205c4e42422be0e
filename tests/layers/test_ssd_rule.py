"""Mamba-2's SSD recurrence: the chunked form against the token-by-token step."""
from __future__ import annotations

import pytest
import torch

from radixserve.layers.gated_delta_rule import CHUNK
from radixserve.layers.ssd_rule import ssd_chunked, ssd_step


@pytest.mark.parametrize("lengths", [(1, 64, 65), (200, 7)])
def test_chunked_ssd_equals_the_recurrence(lengths: tuple[int, ...]) -> None:
    """Sequences padded (k = v = g = 0) to a common multiple of CHUNK, from random states:
    outputs and final states equal the recurrence run one token at a time."""
    gen = torch.Generator().manual_seed(0)
    heads, state_size, head_dim = 3, 8, 5
    padded = -(-max(lengths) // CHUNK) * CHUNK
    q = torch.zeros(len(lengths), padded, heads, state_size)
    k, v = torch.zeros_like(q), torch.zeros(len(lengths), padded, heads, head_dim)
    g = torch.zeros(len(lengths), padded, heads)
    start = torch.randn(len(lengths), heads, state_size, head_dim, generator=gen)
    outs, states = [], []
    for r, n in enumerate(lengths):
        qr, kr = (torch.randn(n, heads, state_size, generator=gen) for _ in range(2))
        vr = torch.randn(n, heads, head_dim, generator=gen)
        gr = -torch.rand(n, heads, generator=gen) * 0.3
        q[r, :n], k[r, :n], v[r, :n], g[r, :n] = qr, kr, vr, gr
        state, steps = start[r:r + 1], []
        for t in range(n):
            o, state = ssd_step(qr[t:t + 1], kr[t:t + 1], vr[t:t + 1], gr[t:t + 1], state)
            steps.append(o[0])
        outs.append(torch.stack(steps))
        states.append(state[0])
    out, final = ssd_chunked(q, k, v, g, start)
    for r, n in enumerate(lengths):
        torch.testing.assert_close(out[r, :n], outs[r], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[r], states[r], atol=1e-4, rtol=1e-4)
