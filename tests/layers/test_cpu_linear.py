"""layers/cpu_linear.py: oneDNN with the weight packed once, and the small-M GEMV kernel, against
F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.cpu_kernels import cpu_ops
from radixserve.layers.cpu_linear import GEMV_MAX_ROWS, _dtype_supported, packed_linear
from radixserve.layers.linear import linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


@pytest.mark.parametrize("rows", [5, 64])
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
    many = torch.randn(GEMV_MAX_ROWS + 1, 8)  # past the GEMV: the packed path
    assert packed_linear(many, w.detach().clone()) is None  # nowhere to cache a packing
    assert packed_linear(x.double(), w) is None
    torch.testing.assert_close(linear(x.view(1, 3, 8), w), F.linear(x, w).view(1, 3, 16))


gemv_needs_kernels = pytest.mark.skipif(cpu_ops() is None, reason="CPU kernels did not build")


@gemv_needs_kernels
@pytest.mark.parametrize("rows", range(1, GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_kernel_matches_a_float64_product(rows: int, dtype: torch.dtype) -> None:
    """N with a tail of rows past the kernel's row block, K with a tail past the vector width,
    with and without bias; fp32 sums rounded once to the dtype."""
    gen = torch.Generator().manual_seed(rows)
    for n, k in ((37, 50), (96, 576), (8, 16)):
        w = torch.randn(n, k, generator=gen).to(dtype)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        for b in (None, bias):
            got = cpu_ops().gemv(x, w, b)
            ref = F.linear(x.double(), w.double(), None if b is None else b.double())
            assert got.dtype == dtype and got.shape == (rows, n)
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), ref, atol=4e-6 * k ** 0.5, rtol=1e-5)
            else:  # one rounding of the fp32 sum (plus the fp32 sum's own error)
                eps = torch.finfo(dtype).eps
                torch.testing.assert_close(got.double(), ref.to(dtype).double(),
                                           atol=4 * eps * k ** 0.5, rtol=2 * eps)


@gemv_needs_kernels
def test_gemv_refuses_bad_shapes() -> None:
    w = torch.randn(16, 8)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        cpu_ops().gemv(torch.randn(5, 8), w, None)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops().gemv(torch.randn(1, 7), w, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_ops().gemv(torch.randn(1, 8).bfloat16(), w, None)


@gemv_needs_kernels
@pytest.mark.parametrize("rows", [1, 3])
def test_linear_sends_decode_rows_to_the_gemv(rows: int) -> None:
    """fp32 always; bf16 only where oneDNN has no native bf16 (else the packed path)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = nn.Parameter(torch.randn(64, 32, generator=gen).to(dtype), requires_grad=False)
        x = torch.randn(2, rows, 32, generator=gen).to(dtype)[:1]  # [1, rows, 32]
        got = linear(x, w)
        assert got.shape == (1, rows, 64)
        via_gemv = cpu_ops().gemv(x.reshape(rows, 32), w, None).view(1, rows, 64)
        if dtype == torch.float32 or not _dtype_supported(dtype):
            assert torch.equal(got, via_gemv)
        torch.testing.assert_close(got.float(), F.linear(x, w).float(),
                                   **({} if dtype == torch.float32 else dict(atol=0.05,
                                                                              rtol=0.02)))
