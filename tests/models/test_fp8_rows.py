"""FP8 decode rows quantised by the kernel before the product (DecoderLayer.forward_fp8_rows):
RMSNorm and SiLU-mul emitting e4m3 codes and row scales (the Triton interpreter on CPU), the
layer routing, and the Engine's greedy tokens with the codes on the tensor-core kernel."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers import linear as linear_module  # noqa: E402
from radixserve.layers.kernels import fp8_gemm, fp8_mma_rows  # noqa: E402
from radixserve.layers.kernels.per_token_quant import per_token_quant_reference  # noqa: E402
from radixserve.layers.kernels.rmsnorm import fused_rmsnorm_quant, rmsnorm_reference  # noqa: E402
from radixserve.layers.kernels.silu_and_mul import (silu_and_mul_quant,  # noqa: E402
                                                    silu_and_mul_reference)
from radixserve.layers.quantization.fp8 import FP8_DTYPE, quantize_rows  # noqa: E402
from radixserve.models import blocks  # noqa: E402
from tests.models.engine_greedy import engine_greedy_tokens  # noqa: E402
from tests.models.tiny_checkpoints import make_checkpoint  # noqa: E402
from tests.triton_interpreter import fix_fp8_rounding  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

fix_fp8_rounding()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16


def _values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float().cpu() * scales.float().cpu()


def _assert_same_rows(codes, scales, want: torch.Tensor) -> None:
    """The rows equal per_token_quant's of `want`: scales to float32 rounding, codes to at
    most one step of e4m3 where the float32 quotient sits on a rounding boundary."""
    want_codes, want_scales = per_token_quant_reference(want.float().cpu(), FP8_DTYPE)
    torch.testing.assert_close(scales.cpu(), want_scales, rtol=1e-6, atol=0)
    step = want_scales * 2.0 ** -3 * want_codes.float().abs().clamp(min=2 ** -6)
    assert ((_values(codes, scales) - _values(want_codes, want_scales)).abs()
            <= step + 1e-12).all()
    assert (codes.float().cpu() == want_codes.float()).float().mean() > 0.99


@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_emits_the_rows_per_token_quant_makes_of_its_output(with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 256, generator=gen) * 2).to(DTYPE)
    residual = (torch.randn(5, 256, generator=gen) * 3).to(DTYPE) if with_residual else None
    x[2, 7] = 40.0  # an outlier column sets its row's scale
    weight = (1 + 0.2 * torch.randn(256, generator=gen)).to(DTYPE)
    codes, scales, stream = fused_rmsnorm_quant(
        x.to(DEVICE), weight.to(DEVICE), 1e-5,
        None if residual is None else residual.to(DEVICE), FP8_DTYPE)
    want = rmsnorm_reference(x, weight, 1e-5, residual)
    if with_residual:
        want, want_stream = want
        torch.testing.assert_close(stream.cpu(), want_stream)
    else:
        assert stream is None
    assert codes.dtype == FP8_DTYPE and scales.shape == (5, 1)
    _assert_same_rows(codes, scales, want)


@pytest.mark.parametrize("block", [256, 64])  # the row in registers; read twice in blocks
def test_silu_and_mul_emits_the_rows_per_token_quant_makes_of_its_output(block: int) -> None:
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 2 * 200, generator=gen) * 2).to(DTYPE)  # 200: the last block masked
    codes, scales = silu_and_mul_quant(x.to(DEVICE), FP8_DTYPE, block=block)
    assert codes.shape == (3, 200)
    _assert_same_rows(codes, scales, silu_and_mul_reference(x))


def test_zero_rows_get_a_finite_scale() -> None:
    rows = quantize_rows(torch.zeros(2, 64, dtype=DTYPE))
    assert torch.isfinite(rows.scales).all() and not rows.codes.float().any()
    assert (rows.dequantize() == 0).all()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_biases_i128")
    make_checkpoint("llama_biases_i128", folder)
    return str(folder)


def _greedy(checkpoint: str, lengths: tuple[int, ...] = (12, 20, 7),
            dtype: str = "float16") -> list[list[int]]:
    # three requests: every decode step is three rows (few steps: the interpreter is slow)
    return engine_greedy_tokens(checkpoint, lengths, 3, dtype=dtype, quantization="fp8")


def test_engine_decode_rows_take_activation_codes(checkpoint, monkeypatch) -> None:
    """With a "codes" configuration for three rows, both norms and SiLU-mul quantise and
    q|k|v, gate|up and down run on the codes: the greedy tokens are those of the layers
    without it (FP8 weights, unquantised activations), and those of the same quantised rows
    dequantised and multiplied in float16 (the fallback without the tensor-core kernel)."""
    plain = _greedy(checkpoint)
    monkeypatch.setattr(blocks, "one_row_kernels_apply", lambda hidden: hidden.dim() == 2)
    configs: list[tuple[int, int, int]] = []

    def config(n: int, k: int, m: int, group_k: int | None):  # type: ignore[no-untyped-def]
        configs.append((n, k, m))
        # 2-16 rows (a CUDA graph pads the three rows to its batch size)
        return fp8_mma_rows.MmaRowsConfig(64, 64, 4, 2, split_k=2) if 2 <= m <= 16 else None

    monkeypatch.setattr(fp8_gemm, "fp8_codes_config", config)
    calls = []
    codes_path = blocks.DecoderLayer.forward_fp8_rows
    monkeypatch.setattr(blocks.DecoderLayer, "forward_fp8_rows",
                        lambda self, *args: calls.append(1) or codes_path(self, *args))
    products = []
    kernel = fp8_mma_rows.fp8_mma_rows
    monkeypatch.setattr(fp8_mma_rows, "fp8_mma_rows", lambda *args, **kw: products.append(
        kw.get("x_scale") is not None) or kernel(*args, **kw))
    got = _greedy(checkpoint)
    assert got == plain
    assert calls and any(products)  # the layers took the codes path, the kernel took codes
    assert any(2 < m <= 16 for _, _, m in configs)
    monkeypatch.setattr(fp8_mma_rows, "available", lambda x: False)  # dequantise instead
    products.clear()
    assert _greedy(checkpoint) == got
    assert not products


def test_engine_decode_rows_past_sixteen_take_activation_codes(checkpoint, monkeypatch) -> None:
    """Eighteen requests: every decode step is 18 rows, which the kernel takes in a 32-row
    tile; the greedy tokens are those of the layers without the codes path."""
    lengths = tuple(5 + (7 * i) % 13 for i in range(18))
    plain = _greedy(checkpoint, lengths)
    monkeypatch.setattr(blocks, "one_row_kernels_apply", lambda hidden: hidden.dim() == 2)
    rows_seen: list[int] = []

    def config(n: int, k: int, m: int, group_k: int | None):  # type: ignore[no-untyped-def]
        rows_seen.append(m)
        return fp8_mma_rows.MmaRowsConfig(64, 64, 4, 2) if 16 < m <= 128 else None

    monkeypatch.setattr(fp8_gemm, "fp8_codes_config", config)
    tiles = []
    kernel = fp8_mma_rows.fp8_mma_rows
    monkeypatch.setattr(fp8_mma_rows, "fp8_mma_rows", lambda *args, **kw: tiles.append(
        (args[0].shape[0], kw.get("x_scale") is not None)) or kernel(*args, **kw))
    assert _greedy(checkpoint, lengths) == plain
    # 18 rows of codes in one launch (a CUDA graph pads them to its batch size, at most 32)
    assert any(18 <= m <= 32 for m in rows_seen)
    assert any(18 <= rows <= 32 and codes for rows, codes in tiles)



def test_engine_batches_past_the_code_rows_take_codes_on_scaled_mm(checkpoint,
                                                                   monkeypatch) -> None:
    """A prefill batch of more rows than the tensor-core kernel takes (159 > MAX_CODE_ROWS):
    both norms and SiLU-mul quantise, and q|k|v, gate|up and down run _scaled_mm on their
    codes, where the bf16 rows went to _scaled_mm through a quantisation pass of their own
    (RADIXSERVE_FP8_PREQUANT_BATCHES=0). The greedy tokens are the same. On CPU a float
    reference stands in for _scaled_mm, and batches of 64 rows or more take the GPU's route."""
    lengths = (150, 9)
    on_gpu = torch.cuda.is_available()
    dtype = "bfloat16" if on_gpu else "float16"
    product = fp8_gemm.scaled_mm_codes
    if not on_gpu:
        def product(codes, x_scale, weight, scale, bias, out_dtype):  # type: ignore[no-redef]
            y = (codes.float() * x_scale) @ (weight.float() * scale.float()).t()
            return (y if bias is None else y + bias.float()).to(out_dtype)

        plain_linear = linear_module.fp8_linear

        def batch_linear(x, weight, scale, block, bias):  # type: ignore[no-untyped-def]
            if x.dim() == 2 and x.shape[0] >= 64:  # scaled_mm_per_token's quantisation pass
                codes, scales = per_token_quant_reference(x.float(), FP8_DTYPE)
                return product(codes, scales, weight, scale, bias, x.dtype)
            return plain_linear(x, weight, scale, block, bias)

        monkeypatch.setattr(linear_module, "fp8_linear", batch_linear)
        monkeypatch.setattr(fp8_gemm, "scaled_mm_takes",
                            lambda weight, scale_cols, tokens, dtype: tokens >= 64)
    monkeypatch.setattr(fp8_gemm, "PREQUANT_BATCHES", False)
    plain = _greedy(checkpoint, lengths, dtype)
    monkeypatch.setattr(fp8_gemm, "PREQUANT_BATCHES", True)
    monkeypatch.setattr(blocks, "one_row_kernels_apply", lambda hidden: hidden.dim() == 2)
    monkeypatch.setattr(fp8_gemm, "fp8_codes_config", lambda *args: None)  # no decode rows
    monkeypatch.setattr(fp8_gemm, "scaled_mm_codes", product)
    batches: list[int] = []  # rows of each codes product (o_proj quantises its own rows)
    codes_product = fp8_gemm.fp8_codes_product
    monkeypatch.setattr(fp8_gemm, "fp8_codes_product", lambda codes, *args: batches.append(
        codes.shape[0]) or codes_product(codes, *args))
    assert _greedy(checkpoint, lengths, dtype) == plain
    # the prefill's q|k|v, gate|up and down took the norms' and SiLU-mul's codes (on the GPU
    # so did the CUDA graphs' captures of more than MAX_CODE_ROWS rows)
    assert batches.count(sum(lengths)) % 3 == 0 and sum(lengths) in batches
    assert all(rows > fp8_mma_rows.MAX_CODE_ROWS for rows in batches)
