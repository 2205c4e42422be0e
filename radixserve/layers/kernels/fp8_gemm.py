"""The GPU linear over FP8 weight codes [N, K] with scales [N, G], x [M, K] bf16/fp16.

Up to 16 rows, where the H200 sweep found it faster: the FP8 tensor-core kernel
(kernels/fp8_mma_rows.py), which feeds the codes to e4m3 MMAs and quantises the activations in
registers (up to 128 rows of activations quantised beforehand: `fp8_codes_product`). Otherwise one row: the FP8 GEMV (kernels/gemv.py); decode-sized batches: the skinny
tile GEMM (kernels/skinny_gemm.py), which loads FP8 codes (half the bytes of bf16) and runs the
bf16 tensor cores. Per-shape configurations swept on the H200 come from `gemm_tables`. Large
per-channel batches: `torch._scaled_mm` (cuBLASLt, FP8 tensor cores) with activations quantised
per token, by a pass of their own or, where the layer runs on codes (`fp8_codes_product`), by the
RMSNorm or SiLU-mul before. Block-scaled weights always take the Triton kernels.
"""
from __future__ import annotations

import os

import torch

from radixserve.layers.kernels import fp8_mma_rows
from radixserve.layers.kernels.gemm_tables import tuned_entry
from radixserve.layers.kernels.gemv import NO_FUSION, RowFusion, fp8_gemv
from radixserve.layers.kernels.per_token_quant import per_token_quant
from radixserve.layers.kernels.skinny_gemm import (config_from_entry, default_config,
                                                   skinny_gemm)

# RADIXSERVE_FP8_ROW_CODES=0: decode rows are not quantised by the kernel before the product
# (DecoderLayer.forward_fp8_rows off; for A/B timing)
CODES_ENABLED = os.environ.get("RADIXSERVE_FP8_ROW_CODES", "1") != "0"
SCALED_MM_MIN_TOKENS = 64  # per-channel weights at this many rows and more (without a swept
# entry): FP8 tensor cores; the H200 sweep had _scaled_mm ahead of the Triton tiles from M=64
# RADIXSERVE_FP8_PREQUANT_BATCHES=0: batches past the tensor-core kernel's rows (prefill, large
# decode batches) keep bf16 rows into the product, which quantises them in a pass of its own,
# instead of taking the codes the RMSNorm / SiLU-mul before it emit (for A/B timing)
PREQUANT_BATCHES = os.environ.get("RADIXSERVE_FP8_PREQUANT_BATCHES", "1") != "0"
# RADIXSERVE_FP8_FAST_ACCUM=0: _scaled_mm promotes the FP8 tensor cores' accumulator to float32
# along K (for A/B timing and error checks). By default it keeps the accumulator as it is
# (use_fast_accum), as the FP8 GEMMs of vLLM and SGLang do: on the H200 (session 21,
# benchmarks/gpu_scaled_mm.py) 1.03-1.29x the rate at 256-900 rows, and its added error
# (~5e-3 of the output's range, 1e-2 at K = 14336) does not move the product's error against
# the unquantised bf16 one (3.6-4.0e-2 either way), which the FP8 codes themselves set
FAST_ACCUM = os.environ.get("RADIXSERVE_FP8_FAST_ACCUM", "1") != "0"
# 17-128 rows of bf16 activations quantised by per_token_quant for the tensor-core kernel's
# "codes" configuration, where its sweep margin over the incumbent ("base_us" - "us") pays
# for that pass too (~1.9 us on the H200, session 12)
QUANT_PASS_US = 2.0


def fp8_weight_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    group_k: int | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (codes [N, K] x scale [N, G]).T (+ bias) -> [..., N] in x's dtype.
    group_k: the columns per scale group (block size) when G > 1."""
    n, k = weight.shape
    m = x.numel() // k
    grouped = scale.shape[1] > 1
    cfg = config_from_entry(tuned_entry("fp8", n, k, m)) or \
        default_config(m, n, k, group_k if grouped else None)
    return skinny_gemm(x, weight, cfg, scale, group_k, bias)


def scaled_mm_per_token(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """Activations quantised per token (dynamic, one Triton pass), FP8 x FP8 on the tensor
    cores with row-wise scales (cuBLASLt through torch._scaled_mm); per-channel weight scales
    only."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    x_codes, x_scale = per_token_quant(x2, weight.dtype)
    y = scaled_mm_codes(x_codes, x_scale, weight, scale, bias, x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def scaled_mm_codes(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                    scale: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """Activation codes [M, K] (e4m3, one scale per row) against per-channel FP8 weight codes
    on cuBLASLt's FP8 tensor cores, row-wise scales on both sides."""
    return torch._scaled_mm(codes, weight.t(), scale_a=x_scale,
                            scale_b=scale.reshape(1, -1).contiguous(), bias=bias,
                            out_dtype=out_dtype, use_fast_accum=FAST_ACCUM)


def scaled_mm_takes(weight: torch.Tensor, scale_cols: int, tokens: int,
                    dtype: torch.dtype) -> bool:
    """Whether `tokens` rows of `dtype` activations against this FP8 weight run on
    torch._scaled_mm: per-channel scales (scale_cols 1), bf16, a device with FP8 tensor cores
    (sm_90 and later), and the table's choice for this shape (without an entry: from
    SCALED_MM_MIN_TOKENS rows)."""
    n, k = weight.shape
    return (scale_cols == 1 and dtype == torch.bfloat16 and weight.is_cuda
            and torch.cuda.get_device_capability(weight.device)[0] >= 9
            and _wants_scaled_mm(tuned_entry("fp8", n, k, tokens), tokens))


def fp8_rows_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     group_k: int | None, bias: torch.Tensor | None = None,
                     fusion: RowFusion = NO_FUSION) -> torch.Tensor | None:
    """x [M, K] (rows contiguous) with `fusion` on the FP8 tensor-core kernel where its sweep
    won for this shape, row count and fusion; else, for one row, the FP8 GEMV. None when
    neither applies (the caller falls back)."""
    m = x.shape[0]
    if m <= fp8_mma_rows.MAX_ROWS and fp8_mma_rows.available(x):
        config = fp8_mma_rows.tuned_config(weight.shape[0], weight.shape[1], m, fusion.variant)
        if config is not None and scale.shape[1] > 1 and group_k:
            config = fp8_mma_rows.within_group(config, group_k)
        if config is not None:
            return fp8_mma_rows.fp8_mma_rows(x, weight, scale, group_k, config, bias, fusion)
    if m == 1:
        return fp8_gemv(x, weight, scale, group_k, bias, fusion=fusion)
    return None


def fp8_codes_config(n: int, k: int, m: int, group_k: int | None
                     ) -> "fp8_mma_rows.MmaRowsConfig | None":
    """The tensor-core configuration for m rows of activation codes against an [n, k] FP8
    weight (the "codes" variant of the table's "mma" key, written where the sweep found it
    faster than the kernel quantising in registers), or None."""
    if not (0 < m <= fp8_mma_rows.MAX_CODE_ROWS and fp8_mma_rows.ENABLED and CODES_ENABLED):
        return None
    config = fp8_mma_rows.tuned_config(n, k, m, "codes")
    if config is not None and group_k:
        config = fp8_mma_rows.within_group(config, group_k)
    return config


def fp8_codes_product(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                      scale: torch.Tensor, group_k: int | None, bias: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor | None:
    """Activation codes [M, K] (e4m3, one scale per row) against FP8 weight codes, on the
    tensor cores with both operands as loaded: the tensor-core kernel where its sweep left a
    "codes" configuration, _scaled_mm for batches past its rows (`takes_code_rows`); None
    where neither applies."""
    m = codes.shape[0]
    if codes.dtype != torch.float8_e4m3fn:
        return None
    grouped = scale.shape[1] > 1
    config = fp8_codes_config(weight.shape[0], weight.shape[1], m,
                              group_k if grouped else None)
    if config is not None and fp8_mma_rows.available(codes):
        return fp8_mma_rows.fp8_mma_rows(codes, weight, scale, group_k if grouped else None,
                                         config, bias, x_scale=x_scale, out_dtype=out_dtype)
    if _batch_takes_codes(weight, scale.shape[1], m, out_dtype):
        return scaled_mm_codes(codes, x_scale, weight, scale, bias, out_dtype)
    return None


def takes_code_rows(weight: torch.Tensor, scale_cols: int, group_k: int | None, rows: int,
                    dtype: torch.dtype) -> bool:
    """Whether `fp8_codes_product` runs `rows` rows of activation codes against this weight
    as they are: the tensor-core kernel's "codes" configuration (up to MAX_CODE_ROWS), or,
    past those rows, _scaled_mm where the bf16 rows would have gone to it anyway (their
    quantisation then moves into the kernel before: one pass over the activations fewer)."""
    n, k = weight.shape
    return fp8_codes_config(n, k, rows, group_k if scale_cols > 1 else None) is not None \
        or _batch_takes_codes(weight, scale_cols, rows, dtype)


def _batch_takes_codes(weight: torch.Tensor, scale_cols: int, rows: int,
                       dtype: torch.dtype) -> bool:
    return PREQUANT_BATCHES and CODES_ENABLED and rows > fp8_mma_rows.MAX_CODE_ROWS \
        and scaled_mm_takes(weight, scale_cols, rows, dtype)


def _codes_pay_for_quantising(n: int, k: int, m: int) -> bool:
    """Whether m rows (17-128) quantised by a pass of their own, then the tensor-core kernel on
    the codes, beat the incumbent by the swept entry's margin."""
    entry = (((tuned_entry("fp8", n, k, m) or {}).get("mma") or {}).get("codes")) or {}
    return "us" in entry and entry.get("base_us", 0.0) - entry["us"] > QUANT_PASS_US


def _wants_scaled_mm(entry: dict | None, tokens: int) -> bool:
    """The table's choice where its entry made one (a vendor kernel or a tile configuration);
    an entry holding only other sweeps' configurations (the tensor-core kernel's "mma", at 128
    rows say) leaves it to the row count."""
    if not entry or ("kernel" not in entry and "BLOCK_N" not in entry):
        return tokens >= SCALED_MM_MIN_TOKENS
    # a vendor entry whose Triton tile came close enough runs the tile (config_from_entry)
    return entry.get("kernel") == "scaled_mm" and config_from_entry(entry) is None


def fp8_weight_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      block: int | None, bias: torch.Tensor | None) -> torch.Tensor:
    """The GPU FP8 linear: decode rows on `fp8_rows_product` where it applies (up to 16 rows;
    17-128 rows through per_token_quant and the codes kernel where that pays), _scaled_mm for
    large per-channel batches (when the device has FP8 tensor cores), else the
    weight-dequantising Triton GEMM."""
    tokens = x.numel() // x.shape[-1]
    n, k = weight.shape
    if 0 < tokens <= fp8_mma_rows.MAX_ROWS and x.is_contiguous():  # decode rows
        y = fp8_rows_product(x.reshape(tokens, -1), weight, scale, block, bias)
        if y is not None:
            return y.view(*x.shape[:-1], n)
    elif (tokens <= fp8_mma_rows.MAX_CODE_ROWS and x.is_contiguous()
          and _codes_pay_for_quantising(n, k, tokens)):
        codes, x_scale = per_token_quant(x.reshape(tokens, -1), weight.dtype)
        y = fp8_codes_product(codes, x_scale, weight, scale, block, bias, x.dtype)
        if y is not None:
            return y.view(*x.shape[:-1], n)
    if scaled_mm_takes(weight, scale.shape[1], tokens, x.dtype):
        return scaled_mm_per_token(x, weight, scale, bias)
    return fp8_weight_gemm(x, weight, scale, block, bias)


def fp8_weight_gemm_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                              group_k: int | None) -> torch.Tensor:
    from radixserve.layers.quantization.fp8 import dequantize_weight
    return x.float() @ dequantize_weight(weight, scale, group_k, torch.float32).t()
