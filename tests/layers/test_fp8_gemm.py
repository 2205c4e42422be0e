"""The FP8-weight GEMM (Triton; interpreter on CPU at small shapes) against the dequantised
PyTorch product, per-channel and block scales, decode and prefill row counts."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.kernels.fp8_gemm import (fp8_weight_gemm,  # noqa: E402
                                                fp8_weight_gemm_reference)
from radixserve.layers.quantization.fp8 import quantize_per_channel  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,n,k,block", [(1, 48, 256, None), (5, 40, 200, None),
                                         (3, 64, 256, 128), (70, 96, 384, 128),
                                         (8, 64, 2048, None), (20, 32, 1536, 128),
                                         (4, 32, 192, 64), (2, 48, 96, 16)])
def test_fp8_weight_gemm_matches_dequantised_product(m, n, k, block) -> None:
    """(8, 64, 2048) and (20, 32, 1536) split K (small M, few output tiles, long K); groups of
    64 and 16 columns are a tensor-parallel rank's finer groups (fp8.rank_group_k)."""
    gen = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=gen)
    if block is None:
        codes, scale = quantize_per_channel(w)
    else:
        groups = -(-k // block)
        scale = torch.rand(n, groups, generator=gen) * 0.01 + 0.001
        codes = (w / scale.repeat_interleave(block, 1)[:, :k]).clamp(-448, 448).to(
            torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    got = fp8_weight_gemm(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), block,
                          bias.to(DEVICE))
    want = fp8_weight_gemm_reference(x, codes, scale, block) + bias.float()
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("n,k,block", [(40, 512, None), (24, 1024, 128), (24, 192, 64),
                                       (16, 256, 16)])
def test_fp8_gemv_matches_dequantised_product(n, k, block) -> None:
    from radixserve.layers.kernels.gemv import fp8_gemv
    gen = torch.Generator().manual_seed(n)
    groups = 1 if block is None else k // block
    scale = torch.rand(n, groups, generator=gen) * 0.01 + 0.001
    codes = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    x = torch.randn(1, k, generator=gen).to(torch.float16)
    got = fp8_gemv(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), block)
    assert got is not None
    want = fp8_weight_gemm_reference(x, codes, scale, block)
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)



@pytest.mark.parametrize("m,k", [(1, 64), (5, 300), (3, 4096)])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_per_token_quant_matches_the_reference(m, k, fp8) -> None:
    from radixserve.layers.kernels.per_token_quant import (per_token_quant,
                                                           per_token_quant_reference)
    gen = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10).to(
        torch.float16)
    x[0] = 0  # an all-zero row keeps a finite scale
    codes, scales = per_token_quant(x.to(DEVICE), fp8)
    want_codes, want_scales = per_token_quant_reference(x, fp8)
    assert codes.dtype == fp8 and scales.shape == (m, 1)
    torch.testing.assert_close(scales.cpu(), want_scales)
    same = (codes.cpu().float() == want_codes.float()).float().mean()
    if DEVICE == "cuda":  # the GPU's cast rounds to nearest even, as torch's does
        assert same == 1.0
    else:  # the interpreter's FP8 cast rounds some values past 64 down a whole binade
        assert same > 0.9
