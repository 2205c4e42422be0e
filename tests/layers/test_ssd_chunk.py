"""kernels/ssd_chunk.py: the chunked SSD scan in one launch, read from the conv's padded
x | B | C output, against the token-by-token recurrence (layers/ssd_rule.ssd_step with D's
term), for sequences of different lengths padded together, groups shared by several heads,
state and head sizes below their powers of two, from random states."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.gated_delta_rule import CHUNK  # noqa: E402
from radixserve.layers.kernels.ssd_chunk import ssd_chunked_triton  # noqa: E402
from radixserve.layers.ssd_rule import ssd_step  # noqa: E402

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("lengths,heads,groups,state,head_dim,dtype", [
    ((1, 64, 70), 4, 2, 16, 8, torch.float32),  # two heads per group, a one-token sequence
    ((130, 5), 3, 1, 12, 24, torch.float32),  # one group; sizes off their powers of two
    ((70,), 2, 1, 128, 64, torch.float16)])  # Nemotron's state and head sizes, half input
def test_scan_equals_the_recurrence(lengths, heads, groups, state, head_dim, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    inner = heads * head_dim
    channels = inner + 2 * groups * state
    padded = -(-max(lengths) // CHUNK) * CHUNK
    conv = torch.zeros(len(lengths), padded, channels)
    dt = torch.zeros(len(lengths), padded, heads)
    a_log = torch.rand(heads, generator=gen) - 2
    d = torch.rand(heads, generator=gen) + 0.5
    start = torch.randn(len(lengths), heads, state, head_dim, generator=gen)
    expected, finals = [], []
    per_group = heads // groups
    for r, n in enumerate(lengths):
        # as the kernel reads it: rounded to the conv's dtype
        conv[r, :n] = (torch.randn(n, channels, generator=gen) * 0.5).to(dtype).float()
        dt[r, :n] = torch.rand(n, heads, generator=gen) * 0.5
        x = conv[r, :n, :inner].unflatten(-1, (heads, head_dim))
        b, c = conv[r, :n, inner:].split(groups * state, dim=-1)
        b = b.unflatten(-1, (groups, state)).repeat_interleave(per_group, dim=1)
        c = c.unflatten(-1, (groups, state)).repeat_interleave(per_group, dim=1)
        s, ys = start[r:r + 1], []
        for t in range(n):
            y, s = ssd_step(c[t:t + 1], b[t:t + 1], (x[t] * dt[r, t, :, None])[None],
                            (dt[r, t] * -a_log.exp())[None], s)
            ys.append(y[0] + d[:, None] * x[t])
        expected.append(torch.stack(ys))
        finals.append(s[0])
    to = {"device": DEVICE}
    out, final = ssd_chunked_triton(conv.to(dtype).to(**to), dt.to(**to), a_log.to(**to),
                                    d.to(**to), start.to(**to), heads, head_dim, groups, state)
    tol = 2e-2 if DEVICE == "cuda" else 1e-4  # TF32 products on the GPU
    for r, n in enumerate(lengths):
        torch.testing.assert_close(out[r, :n].cpu(), expected[r], atol=tol, rtol=tol)
        torch.testing.assert_close(final[r].cpu(), finals[r], atol=tol, rtol=tol)
