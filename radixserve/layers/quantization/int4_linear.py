"""Int4 (W4A16) parameters of a linear layer: creation, checkpoint loading, the after-load
step, and the product.

While loading, a layer built under an int4 setting (int4.py) holds the checkpoint's tensors in
the layers' orientation, under the checkpoint's own names so the generic loader finds them:
codes int32 words [N, K / 8] in the one layout (int4.py), scales [N, G], zero points uint8
[N, G] (where the format has them), g_idx int32 [K] (act-order formats). Each tensor goes
through the layer's own weight loader after being unpacked, turned and (codes) packed again, so
tensor-parallel and merged-piece placement apply unchanged (a split of the input features takes
whole words) and the codes never take more memory than their packed size (a 70B model loads
within its int4 footprint). `finish_int4_loading` then keeps
`int4_qweight`, `int4_scales`, `int4_zeros` (None when every zero point is 8) and `int4_perm`
(the act-order permutation of the input features, or None).

Where the packed product cannot serve, the layer is dequantised once into an ordinary weight in
the compute dtype (same values, 4x the memory): on the CPU (RADIXSERVE_INT4_CPU=packed keeps the
packed form there, through a reference product), for layers whose weight other kernels read
directly, and for act-order layers whose input features are split over ranks (each rank's
features then belong to groups of all sizes).
"""
from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.quantization.int4 import (PACK, Int4Config, check_weight_shape,
                                                 checkpoint_rows, dequantize_int4,
                                                 dequantize_packed, drop_symmetric_zeros,
                                                 pack_int32, rank_group_columns,
                                                 rank_group_size, unpack_int32)

if TYPE_CHECKING:
    from radixserve.layers.linear import LinearBase

logger = logging.getLogger(__name__)

PACKED_ON_CPU = os.environ.get("RADIXSERVE_INT4_CPU", "dense") == "packed"


def _param(shape: tuple[int, ...], dtype: torch.dtype | None, loader, *, optional: bool = False,
           columns_placed: bool = False) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.keep_dtype = dtype is not None  # type: ignore[attr-defined]
    param.optional = optional  # type: ignore[attr-defined]
    # its loader places the rank's columns: RowParallelLinear does not split them again
    param.columns_placed = columns_placed  # type: ignore[attr-defined]
    return param


def _checkpoint_features(layer: "LinearBase") -> int:
    """The layer's input features in the checkpoint (all ranks' where they are split)."""
    return layer.input_size * (layer.tp_size if layer.input_is_split else 1)


def add_int4_params(layer: "LinearBase", config: Int4Config) -> None:
    """Called by LinearBase.__init__ (which makes no `weight` for an int4 layer)."""
    k_rank, n = layer.input_size, layer.output_size
    split = layer.input_is_split and layer.tp_size > 1
    k_full = _checkpoint_features(layer)
    group = config.group_of(k_full)
    if k_rank % PACK:
        raise ValueError(f"int4 layer with {k_rank} input features on a rank (not a multiple "
                         f"of {PACK})")
    # act-order groups hold features from anywhere in the row: a rank of split input features
    # keeps every group's scale (and is dequantised after loading, see finish_int4_loading)
    every_group = config.group_size != -1 and config.act_order and split
    rank_group = group if every_group or config.group_size == -1 else \
        rank_group_size(k_rank, group)
    if config.group_size == -1:
        groups = 1
    else:
        groups = -(-k_full // group) if every_group else k_rank // rank_group
    # scales placed by their loader (every group, one per row, or regrouped), not split again
    whole = config.group_size == -1 or every_group or rank_group != group
    names = config.names
    load = functools.partial(load_int4_tensor, layer)
    setattr(layer, names["codes"], _param((n, k_rank // PACK), torch.int32,
                                          functools.partial(load, "codes")))
    setattr(layer, names["scales"], _param((n, groups), None, functools.partial(load, "scales"),
                                           columns_placed=whole))
    if not config.symmetric:
        setattr(layer, names["zeros"], _param((n, groups), torch.uint8,
                                              functools.partial(load, "zeros"),
                                              columns_placed=whole))
    if config.method == "gptq" or config.act_order:
        # GPTQ files carry g_idx with or without act-order (trivial without)
        setattr(layer, names["g_idx"], _param((k_rank,), torch.int32,
                                              functools.partial(load_g_idx, layer),
                                              optional=not config.act_order))
    if config.method == "compressed-tensors":
        layer.weight_shape = _param((2,), torch.int64, functools.partial(check_shape, layer),
                                    optional=True)
    if config.method == "gptq" and layer.bias is None and not config.dummy:
        # AutoGPTQ saves a bias for every layer, zeros where the model has none
        layer.bias = _param((n,), None, layer.weight_loader, optional=True)
        layer.int4_bias_from_checkpoint = True
    layer.int4_group = rank_group  # input features per scale column on this rank
    layer.int4_checkpoint_group = group
    layer.int4_every_group = every_group
    layer.int4_g_idx_pieces = set()


def load_int4_tensor(layer: "LinearBase", kind: str, param: nn.Parameter,
                     loaded: torch.Tensor, shard_id: object = None) -> None:
    """A checkpoint's codes / scales / zeros, unpacked and turned to [rows, columns] (codes
    packed again along the columns, in order), then placed by the layer's own loader."""
    assert layer.int4 is not None
    rows = checkpoint_rows(layer.int4, kind, loaded, layer.full_rows(shard_id))
    if kind != "codes" and layer.int4_group != layer.int4_checkpoint_group:
        # a rank whose input features start or end inside groups: finer groups, each holding
        # its checkpoint group's scale and zero point
        offset = layer.tp_rank * layer.input_size
        rows = rows[:, rank_group_columns(offset, layer.input_size, layer.int4_group,
                                          layer.int4_checkpoint_group, rows.device)]
    layer.weight_loader(param, rows, shard_id)


def load_g_idx(layer: "LinearBase", param: nn.Parameter, loaded: torch.Tensor,
               shard_id: object = None) -> None:
    """Each input feature's group; the pieces of a merged layer share their input, and must
    share its order."""
    k_rank, k_full = param.shape[0], _checkpoint_features(layer)
    if loaded.shape != (k_full,):
        raise ValueError(f"g_idx of shape {tuple(loaded.shape)}, expected ({k_full},)")
    if layer.input_is_split:
        loaded = loaded.narrow(0, layer.tp_rank * k_rank, k_rank)
    loaded = loaded.to(torch.int32)
    if layer.int4_g_idx_pieces and not torch.equal(param.data, loaded.to(param.device)):
        raise ValueError("the pieces of this merged layer were quantised in different input "
                         "orders (g_idx differs)")
    layer.int4_g_idx_pieces.add(shard_id)
    param.data.copy_(loaded)


def check_shape(layer: "LinearBase", param: nn.Parameter, loaded: torch.Tensor,
                shard_id: object = None) -> None:
    """compressed-tensors' weight_shape: the piece's unquantised [rows, input features]."""
    check_weight_shape(loaded, layer.full_rows(shard_id), _checkpoint_features(layer))


def _scales_param(layer: "LinearBase") -> nn.Parameter:
    assert layer.int4 is not None
    return getattr(layer, layer.int4.names["scales"])


def _column_groups(layer: "LinearBase", g_idx: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """Each of this rank's input features' column in the scales as loaded (this rank's groups,
    or every checkpoint group where the rank keeps them all), and whether the features arrived
    out of group order (act-order)."""
    k_rank, rank_group = layer.input_size, layer.int4_group
    device = _scales_param(layer).device
    groups = _scales_param(layer).shape[1]
    offset = layer.tp_rank * k_rank if layer.input_is_split else 0
    if groups == 1:
        return torch.zeros(k_rank, dtype=torch.long, device=device), False
    in_order = (torch.arange(k_rank, device=device) + offset) // layer.int4_checkpoint_group
    out_of_order = g_idx is not None and not torch.equal(g_idx.long(), in_order)
    if layer.int4_every_group:
        return (g_idx.long() if out_of_order else in_order), out_of_order  # type: ignore
    if not out_of_order:
        return torch.arange(k_rank, device=device) // rank_group, False
    assert g_idx is not None
    columns = g_idx.long() - offset // layer.int4_checkpoint_group
    if rank_group != layer.int4_checkpoint_group or columns.min() < 0 or \
            columns.max() >= groups:
        raise ValueError("g_idx names groups outside this rank's input features; the "
                         "checkpoint's config does not declare act-order (desc_act)")
    return columns, True


def finish_int4_loading(layer: "LinearBase") -> None:
    """Pack the loaded codes, or dequantise the layer where the packed product cannot serve."""
    config = layer.int4
    if config is None:
        return
    names = config.names
    packed = getattr(layer, names["codes"]).data
    scales = _scales_param(layer).data
    zeros_param = getattr(layer, names["zeros"], None)
    zeros = None if zeros_param is None else zeros_param.data
    g_idx_param = getattr(layer, names["g_idx"], None)
    g_idx = None if g_idx_param is None or not layer.int4_g_idx_pieces else g_idx_param.data
    columns, out_of_order = _column_groups(layer, g_idx)
    zeros = drop_symmetric_zeros(zeros)
    if getattr(layer, "int4_bias_from_checkpoint", False):
        if bool((layer.bias == 0).all()):
            layer.bias = None
        elif not getattr(layer, "reduce_results", True):
            raise ValueError("a GPTQ bias on an unreduced row-parallel layer")
    drop_int4_params(layer, keep_bias=True)
    k = packed.shape[1] * PACK
    contiguous = scales.shape[1] == 1
    if not contiguous:  # each group's features all here, groups in a row: the packed product's
        first = int(columns.min())
        span = k // layer.int4_group
        contiguous = bool(torch.equal(columns.sort().values - first,
                                      torch.arange(k, device=columns.device)
                                      // layer.int4_group))
        if contiguous:  # a rank keeping every group's scale uses its own groups' only
            columns = columns - first
            scales = scales[:, first:first + span].contiguous()
            zeros = None if zeros is None else zeros[:, first:first + span].contiguous()
    dense_on_cpu = packed.device.type == "cpu" and not PACKED_ON_CPU
    if not contiguous and not dense_on_cpu:
        _warn_dense_once()
    if dense_on_cpu or getattr(layer, "weight_read_directly", False) or not contiguous:
        _make_dense(layer, dequantize_int4(unpack_int32(packed), scales, zeros, columns,
                                           scales.dtype))
        return
    perm = None
    if out_of_order:
        perm = torch.argsort(columns, stable=True)
        packed = pack_int32(unpack_int32(packed)[:, perm])
    layer.int4_qweight = _runtime(packed)
    layer.int4_scales = nn.Parameter(scales, requires_grad=False)
    layer.int4_zeros = None if zeros is None else _runtime(zeros.contiguous())
    layer.int4_perm = None if perm is None else _runtime(perm.to(torch.int64))
    layer.int4_group_k = k if scales.shape[1] == 1 else layer.int4_group


def drop_int4_params(layer: "LinearBase", keep_bias: bool = False) -> None:
    """Remove the loading-time int4 parameters (after packing them, or where the checkpoint
    leaves the layer unquantised: then GPTQ's placeholder bias goes too, unless keep_bias)."""
    assert layer.int4 is not None
    for name in (*layer.int4.names.values(), "weight_shape"):
        if hasattr(layer, name):
            delattr(layer, name)
    if not keep_bias and getattr(layer, "int4_bias_from_checkpoint", False):
        layer.bias = None
        layer.int4_bias_from_checkpoint = False


_WARNED: list[bool] = []


def _warn_dense_once() -> None:
    if not _WARNED:
        _WARNED.append(True)
        logger.warning("int4 act-order layers whose input features are split over ranks hold "
                       "features of every group on each rank: they are dequantised to the "
                       "compute dtype (4x their int4 memory); --tp-size 1, or a checkpoint "
                       "without desc_act, keeps them int4")


def _runtime(tensor: torch.Tensor) -> nn.Parameter:
    param = nn.Parameter(tensor, requires_grad=False)
    param.keep_dtype = True  # type: ignore[attr-defined]
    return param


def _make_dense(layer: "LinearBase", weight: torch.Tensor) -> None:
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
    layer.int4 = None


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, group_k: int, perm: torch.Tensor | None,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x @ dequant(W).T (+ bias) from the packed weight. GPU: Triton kernels that unpack the
    codes in registers (kernels/int4_gemm.py); elsewhere the weight dequantised per call (the
    reference path)."""
    if perm is not None:
        x = x.index_select(-1, perm)
    if x.is_cuda:
        try:
            from radixserve.layers.kernels.int4_gemm import int4_matmul
        except ImportError:
            pass
        else:
            return int4_matmul(x, qweight, scales, zeros, group_k, bias)
    return nn.functional.linear(x, dequantize_packed(qweight, scales, zeros, group_k, x.dtype),
                                bias)
