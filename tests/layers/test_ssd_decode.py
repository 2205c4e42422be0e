"""kernels/ssd_decode.py: one Mamba-2 decode step (the conv with its bias and the row's inputs
shifted, the SSD step on the row's state, D's term) against the torch step of
layers/mamba2_mixer.py, on the rows the requests name, with x | B | C a strided view of the
in-projection's output as the layer passes it."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.gated_delta_rule import conv_step  # noqa: E402
from radixserve.layers.kernels.ssd_decode import ssd_decode  # noqa: E402
from radixserve.layers.ssd_rule import ssd_step  # noqa: E402

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("heads,groups,state,head_dim,bias", [
    (4, 2, 16, 8, True),  # two heads per group
    (3, 1, 8, 48, True),  # one group for all heads, head_dim blocks of 32 with a tail
    (2, 2, 12, 16, False)])  # a state size below its power of two, no conv bias
def test_decode_step_matches_the_torch_path(heads, groups, state, head_dim, bias) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, rows_total, width = 3, 6, 3
    inner = heads * head_dim
    channels = inner + 2 * groups * state
    proj = torch.randn(batch, inner + channels + heads, generator=gen)  # z | x|B|C | dt
    mixed = proj[:, inner:inner + channels]
    dt = torch.nn.functional.softplus(torch.randn(batch, heads, generator=gen))
    a_log = torch.rand(heads, generator=gen) - 2
    d = torch.rand(heads, generator=gen) + 0.5
    weight = torch.randn(channels, width + 1, generator=gen) * 0.5
    conv_bias = torch.randn(channels, generator=gen) if bias else None
    conv_states = torch.randn(rows_total, width, channels, generator=gen)
    ssm_states = torch.randn(rows_total, heads, state, head_dim, generator=gen)
    rows = torch.tensor([4, 0, 2])

    conv_ref, ssm_ref = conv_states.clone(), ssm_states.clone()
    conv_out, conv_ref[rows] = conv_step(mixed, weight, conv_ref[rows], conv_bias)
    x, b, c = conv_out.split([inner, groups * state, groups * state], dim=-1)
    x = x.unflatten(-1, (heads, head_dim))
    per_group = heads // groups
    b = b.unflatten(-1, (groups, state)).repeat_interleave(per_group, dim=1)
    c = c.unflatten(-1, (groups, state)).repeat_interleave(per_group, dim=1)
    y, ssm_ref[rows] = ssd_step(c, b, x * dt[..., None], dt * -a_log.exp(), ssm_ref[rows])
    expected = y + d[:, None] * x

    to = {"device": DEVICE}
    conv_got, ssm_got = conv_states.to(**to), ssm_states.to(**to)
    got = ssd_decode(proj.to(**to)[:, inner:inner + channels], dt.to(**to), a_log.to(**to),
                     d.to(**to), weight.to(**to),
                     None if conv_bias is None else conv_bias.to(**to), conv_got, ssm_got,
                     rows.to(**to), groups, state, head_dim)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_got.cpu(), conv_ref)
    torch.testing.assert_close(ssm_got.cpu(), ssm_ref, atol=1e-5, rtol=1e-5)
