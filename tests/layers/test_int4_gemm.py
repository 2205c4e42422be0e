"""The W4A16 kernels (Triton; interpreter on CPU at small shapes) against the weight
dequantised in torch: the tensor-core product over unpacked tiles at decode and prefill row
counts, with split K, zero points or none, a bias, and the dequantise-then-cuBLAS path for many
rows."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.kernels import int4_gemm  # noqa: E402
from radixserve.layers.quantization.int4 import dequantize_int4, pack_int32  # noqa: E402

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if torch.cuda.is_available() else \
    [torch.float16, torch.float32]  # the interpreter's tl.dot on bf16 is unreliable


def _weight(n: int, k: int, group: int, zeros: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.005
    z = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8) if zeros else None
    dense = dequantize_int4(codes, scales, z, torch.arange(k) // group, torch.float32)
    return pack_int32(codes), scales, z, dense, codes


@pytest.mark.parametrize("m,n,k,group", [(1, 48, 128, 32), (3, 80, 256, 128), (16, 64, 64, 64),
                                         (40, 96, 128, 32), (1, 64, 2048, 128)])
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_matmul_matches_the_dequantised_product(m, n, k, group, zeros, with_bias,
                                                     dtype) -> None:
    qweight, scales, z, _, codes = _weight(n, k, group, zeros, m * n + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = int4_gemm.int4_matmul(x.to(DEVICE, dtype), qweight.to(DEVICE),
                                scales.to(DEVICE, dtype), None if z is None else z.to(DEVICE),
                                group, None if bias is None else bias.to(DEVICE, dtype))
    # the reference reads the codes as drawn, not through pack / unpack
    want = x.to(dtype).float() @ dequantize_int4(
        codes, scales.to(dtype), z, torch.arange(k) // group,
        torch.float32).t() + (0 if bias is None else bias.to(dtype).float())
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol * want.abs().max().item(),
                               rtol=tol)


def test_a_long_k_splits_over_programs() -> None:
    """Few output tiles over long rows: split K fills the (interpreter's 4) SMs twice over."""
    shape = int4_gemm._gemm_shape(16, 64, 2048, 128, 4)
    assert (shape.block_m, shape.block_n, shape.split_k) == (16, 64, 4)
    one_row = int4_gemm._gemm_shape(1, 64, 8192, 128, 4)  # 8 spans of 128 a step: 8 steps
    assert one_row.block_m == 1 and one_row.magic and one_row.in_place
    assert (one_row.block_n, one_row.step_spans, one_row.split_k) == (8, 8, 1)
    wide = int4_gemm._gemm_shape(1, 16384, 4096, 128, 4)
    assert (wide.block_n, wide.step_spans, wide.num_warps) == (16, 4, 1)


@pytest.mark.parametrize("shape", [int4_gemm.GemmShape(1, 16, 1),
                                   int4_gemm.GemmShape(1, 32, 4, magic=True),
                                   int4_gemm.GemmShape(1, 16, 1, magic=True, step_spans=4),
                                   int4_gemm.GemmShape(1, 8, 2, step_spans=2),
                                   int4_gemm.GemmShape(1, 8, 1, magic=True, step_spans=4,
                                                       in_place=True),
                                   int4_gemm.GemmShape(16, 32, 1, magic=True),
                                   int4_gemm.GemmShape(16, 64, 4),
                                   int4_gemm.GemmShape(16, 64, 1, magic=True),
                                   int4_gemm.GemmShape(16, 32, 2, magic=True, step_spans=2)])
def test_every_launch_shape_computes_the_same_product(shape) -> None:
    """The sweep's variants: the GEMV (BLOCK_M 1) or tensor cores, split K, several spans a
    step, codes converted, through the exponent bits or read in place."""
    n, k, group = 80, 512, 128
    qweight, scales, z, dense, _ = _weight(n, k, group, True, 9)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    got = int4_gemm.int4_matmul(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE),
                                z.to(DEVICE), group, bias.to(DEVICE), shape)
    torch.testing.assert_close(got.cpu(), x @ dense.t() + bias, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("magic", [False, True])
def test_the_dequantise_kernel_writes_the_dense_weight(magic) -> None:
    n, k, group = 48, 256, 64
    qweight, scales, z, dense, _ = _weight(n, k, group, True, 4)
    got = int4_gemm.int4_dequantize(qweight.to(DEVICE), scales.to(DEVICE), z.to(DEVICE), group,
                                    torch.float32, magic)
    torch.testing.assert_close(got.cpu(), dense, atol=0, rtol=0)


def test_many_rows_dequantise_then_multiply() -> None:
    m, n, k, group = int4_gemm.DEQUANT_MIN_ROWS, 32, 64, 32
    qweight, scales, z, dense, _ = _weight(n, k, group, True, 5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    got = int4_gemm.int4_matmul(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE),
                                z.to(DEVICE), group, None)
    torch.testing.assert_close(got.cpu(), x @ dense.t(), atol=1e-4, rtol=1e-4)
