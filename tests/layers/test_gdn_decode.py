"""kernels/gdn_decode.py: one Gated DeltaNet decode step (conv + SiLU with the row's inputs
shifted, the gated delta rule on the row's state) against the plain PyTorch step of
layers/gated_delta_rule.py, on the rows the requests name, with strided inputs as the layer
passes them (views of its in-projections' outputs); kernels/gated_rmsnorm.py against the
layer's GatedRMSNorm and the Mamba-2 mixer's GroupedGatedRMSNorm."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.gated_delta_net import GatedRMSNorm  # noqa: E402
from radixserve.layers.gated_delta_rule import conv_step, prepare_qk, recurrent_step  # noqa
from radixserve.layers.kernels.gated_rmsnorm import gated_rmsnorm  # noqa: E402
from radixserve.layers.kernels.gdn_decode import gdn_decode  # noqa: E402

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("key_heads,value_heads,key_dim,value_dim,width,beta_scale", [
    (2, 4, 16, 8, 3, 1.0),  # two value heads per key head
    (2, 2, 32, 48, 3, 1.0),  # value blocks of 32 with a masked tail
    (1, 3, 8, 16, 2, 2.0)])  # OLMo-Hybrid's beta in [0, 2]
def test_decode_step_matches_the_torch_path(key_heads, value_heads, key_dim, value_dim,
                                            width, beta_scale) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, rows_total = 3, 6
    keys, values = key_heads * key_dim, value_heads * value_dim
    channels = 2 * keys + values
    # the layer's views: q|k|v beside z in one product, b beside a in another
    qkvz = torch.randn(batch, channels + values, generator=gen)
    ba = torch.randn(batch, 2 * value_heads, generator=gen)
    mixed, (b, a) = qkvz[:, :channels], ba.split(value_heads, dim=-1)
    a_log = torch.rand(value_heads, generator=gen) - 3
    dt_bias = torch.rand(value_heads, generator=gen)
    weight = torch.randn(channels, width + 1, generator=gen) * 0.5
    conv_states = torch.randn(rows_total, width, channels, generator=gen)
    ssm = torch.randn(rows_total, value_heads, key_dim, value_dim, generator=gen)
    rows = torch.tensor([4, 0, 2])
    # the reference, on copies
    ref_conv, ref_ssm = conv_states.clone(), ssm.clone()
    conv_out, ref_conv[rows] = conv_step(mixed, weight, ref_conv[rows])
    q, k, v = conv_out.split([keys, keys, values], dim=-1)
    q, k = prepare_qk(q.unflatten(-1, (key_heads, key_dim)),
                      k.unflatten(-1, (key_heads, key_dim)), value_heads // key_heads)
    g = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    ref_out, ref_ssm[rows] = recurrent_step(q, k, v.unflatten(-1, (value_heads, value_dim)),
                                            g, b.sigmoid() * beta_scale, ref_ssm[rows])
    to = {"device": DEVICE}
    conv_dev, ssm_dev = conv_states.to(**to), ssm.to(**to)
    out = gdn_decode(mixed.to(**to), a.to(**to), b.to(**to), a_log.to(**to), dt_bias.to(**to),
                     weight.to(**to), conv_dev, ssm_dev, rows.to(**to), key_heads, key_dim,
                     value_dim, beta_scale)
    torch.testing.assert_close(out.cpu(), ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(conv_dev.cpu(), ref_conv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm_dev.cpu(), ref_ssm, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [16, 48])
def test_gated_rmsnorm_matches_the_module(dtype: torch.dtype, dim: int) -> None:
    """The rule's float32 output and a gate that is a view beside q|k|v, three value heads."""
    gen = torch.Generator().manual_seed(1)
    tokens, heads = 5, 3
    x = torch.randn(tokens, heads, dim, generator=gen) * 3
    wide = torch.randn(tokens, 7 + heads * dim, generator=gen).to(dtype)
    gate = wide[:, 7:]
    norm = GatedRMSNorm(dim, 1e-6).to(dtype)
    norm.weight.data = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    ref = norm(x.to(dtype).reshape(-1, dim), gate.reshape(-1, dim)).reshape(tokens, -1)
    got = gated_rmsnorm(x.to(DEVICE), gate.to(DEVICE), norm.weight.to(DEVICE), 1e-6, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("groups,group,norm_first,dtype", [
    (2, 48, False, torch.float32), (3, 16, True, torch.float32), (2, 64, False, torch.float16)])
def test_group_gated_norm_kernel_matches_the_module(groups, group, norm_first, dtype) -> None:
    """Mamba-2's norm(y * SiLU(z)) per group (Falcon-H1's norm(y) * SiLU(z)), y and z strided
    views of one product as the mixer passes them; float16 as the half-precision rounding."""
    from radixserve.layers.kernels.gated_rmsnorm import group_gated_rmsnorm
    from radixserve.layers.mamba2_mixer import GroupedGatedRMSNorm
    gen = torch.Generator().manual_seed(1)
    width = groups * group
    norm = GroupedGatedRMSNorm(width, group, 1e-5, norm_before_gate=norm_first)
    norm.weight.data = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    both = torch.randn(5, 2 * width + 3, generator=gen).to(dtype)
    y, z = both[:, :width], both[:, width + 3:]
    expected = norm(y, z)
    got = group_gated_rmsnorm(y.to(DEVICE), z.to(DEVICE), norm.weight.to(DEVICE), 1e-5, group,
                              norm_first)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)
