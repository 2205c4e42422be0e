"""layers/cpu_linear.py: oneDNN with the weight packed once, against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.cpu_linear import packed_linear
from radixserve.layers.linear import linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_bf16_is_bit_identical_and_fp32_close(rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        w = nn.Parameter(torch.randn(96, 48, generator=gen).to(dtype), requires_grad=False)
        bias = torch.randn(96, generator=gen).to(dtype)
        x = torch.randn(rows, 48, generator=gen).to(dtype)
        for b in (None, bias):
            got = packed_linear(x, w, b)
            if got is None:  # no bf16 support in this CPU's oneDNN
                assert dtype == torch.bfloat16
                continue
            ref = F.linear(x, w, b)
            if dtype == torch.bfloat16:
                assert torch.equal(got, ref)
            else:
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_repacks_after_an_in_place_edit_and_skips_plain_tensors() -> None:
    w = nn.Parameter(torch.randn(16, 8), requires_grad=False)
    x = torch.randn(3, 8)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    with torch.no_grad():
        w.mul_(2.0)  # a weight update: the packed copy must follow
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    assert packed_linear(x, w.detach().clone()) is None  # nowhere to cache a packing
    assert packed_linear(x.double(), w) is None
    torch.testing.assert_close(linear(x.view(1, 3, 8), w), F.linear(x, w).view(1, 3, 16))
