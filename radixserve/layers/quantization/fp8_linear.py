"""FP8 parameters of a linear layer: creation, checkpoint loading, the after-load step, and
the product.

A quantised LinearBase holds `weight` (float8_e4m3fn [N, K] on this rank; bf16 until
`finish_loading` for --quantization fp8) and `weight_scale` ([N, G] float32, G = 1 or
cdiv(K, group_k); see fp8.py), plus `input_scale` ([1]) when the checkpoint has static ones.
`layer.group_k` is the checkpoint's block, or the finer groups of a rank whose input columns
start inside a block (fp8.rank_group_k); the products take it as their group width. Scale
tensors load through the layer's own weight loader after being expanded to the rows of their
piece (a per-tensor scale to [rows, 1], a block scale to one row per weight row) and, for
block scales, cut to this rank's column groups, so the tensor-parallel and merged-piece
placement of the weights applies to their rows unchanged.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.quantization.fp8 import (FP8_DTYPE, Fp8Config, Fp8Rows,
                                                dequantize_weight, expand_scale,
                                                quantize_per_channel, rank_block_columns,
                                                rank_group_k)

if TYPE_CHECKING:
    from radixserve.layers.linear import LinearBase


def add_fp8_params(layer: "LinearBase", config: Fp8Config) -> None:
    """Called by LinearBase.__init__ after `weight` (already FP8 unless online) exists."""
    layer.group_k = rank_group_k(config.block, layer.input_size,
                                 layer.input_is_split and layer.tp_size > 1)
    groups = 1 if layer.group_k is None else -(-layer.input_size // layer.group_k)
    scale = nn.Parameter(torch.ones(layer.output_size, groups, dtype=torch.float32),
                         requires_grad=False)
    scale.weight_loader = functools.partial(load_scale, layer)  # type: ignore[attr-defined]
    scale.keep_dtype = True  # type: ignore[attr-defined]
    scale.optional = config.online  # type: ignore[attr-defined]  # computed at load
    # load_scale cuts it to this rank's groups: RowParallelLinear does not split it again
    scale.columns_placed = True  # type: ignore[attr-defined]
    layer.weight_scale = scale
    layer.weight.keep_dtype = not config.online  # type: ignore[attr-defined]
    if config.static_input_scale:
        input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32), requires_grad=False)
        input_scale.weight_loader = load_input_scale  # type: ignore[attr-defined]
        input_scale.keep_dtype = True  # type: ignore[attr-defined]
        layer.input_scale = input_scale


def load_scale(layer: "LinearBase", param: nn.Parameter, loaded: torch.Tensor,
               shard_id: object = None) -> object:
    """Expand a checkpoint scale to the rows of its piece (and a block scale's columns to this
    rank's groups), then place its rows as the weights' are."""
    assert layer.fp8 is not None
    block = layer.fp8.block
    expanded = expand_scale(loaded, layer.full_rows(shard_id), block)
    if block is not None:
        k_offset = layer.tp_rank * layer.input_size if layer.input_is_split else 0
        expanded = rank_block_columns(expanded, block, layer.group_k, k_offset,
                                      layer.input_size)
    return layer.weight_loader(param, expanded.contiguous(), shard_id)


def load_input_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """One static activation scale for the merged layer: the largest of its pieces'."""
    param.data.copy_(torch.maximum(param.data, loaded.float().reshape(1)))


def finish_fp8_loading(layer: "LinearBase") -> None:
    """--quantization fp8: the loaded bf16 weight becomes FP8 codes and per-channel scales (of
    the checkpoint's whole rows where the layer holds a rank's columns of them)."""
    config = layer.fp8
    if config is None or not config.online:
        return
    codes, scale = quantize_per_channel(layer.weight.data, layer.checkpoint_row_amax)
    layer.checkpoint_row_amax = None
    layer.weight = nn.Parameter(codes, requires_grad=False)
    layer.weight.keep_dtype = True  # type: ignore[attr-defined]
    layer.weight_scale.data = scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: int | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ dequant(weight).T (+ bias). GPU: Triton kernels that read the FP8 weight and
    dequantise it in registers; elsewhere a dequantised copy (the reference path)."""
    if x.is_cuda:
        try:
            from radixserve.layers.kernels.fp8_gemm import fp8_weight_matmul
        except ImportError:
            pass
        else:
            return fp8_weight_matmul(x, weight, scale, block, bias)
    return nn.functional.linear(x, dequantize_weight(weight, scale, block, x.dtype), bias)


__all__ = ["FP8_DTYPE", "add_fp8_params", "finish_fp8_loading", "fp8_linear"]


def fp8_rows_linear(x: Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, block: int | None,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """Quantised activation rows @ dequant(weight).T (+ bias), in x.dtype: on the GPU the FP8
    tensor cores take both codes as they are (kernels/fp8_gemm.py `fp8_codes_product`) where
    the sweep configured them; elsewhere the rows are dequantised and take `fp8_linear`."""
    try:
        from radixserve.layers.kernels.fp8_gemm import fp8_codes_product
    except ImportError:
        pass
    else:
        y = fp8_codes_product(x.codes, x.scales, weight, scale, block, bias, x.dtype)
        if y is not None:
            return y
    return fp8_linear(x.dequantize(), weight, scale, block, bias)


def takes_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, block: int | None, rows: int,
                   dtype: torch.dtype) -> bool:
    """Whether `fp8_rows_linear` runs `rows` rows of `dtype` activations, quantised beforehand,
    on a kernel that takes their codes (kernels/fp8_gemm.py `takes_code_rows`; else quantising
    the rows beforehand would only add a dequantisation)."""
    try:
        from radixserve.layers.kernels.fp8_gemm import takes_code_rows
    except ImportError:
        return False
    return weight.dtype == FP8_DTYPE and takes_code_rows(weight, scale.shape[1], block, rows,
                                                         dtype)
