"""Int4 (W4A16) routed experts: FusedMoE's gate|up and down stacks from AWQ, GPTQ or
compressed-tensors checkpoints (layers/quantization/int4.py reads the formats).

While loading, the stacks hold each expert's tensors in the layers' orientation under the
checkpoint's names (`w13_qweight` codes, already packed as int4.py's int32 words,
[E, 2I / tp, H / 8], `w13_scales` [E, 2I / tp, G],
`w13_qzeros` uint8 [E, 2I / tp, G], the same for w2 over [E, H, I / tp]; compressed-tensors'
names for its checkpoints). A rank takes its rows of gate and up, and its input features of down
with their groups (a split inside groups keeps finer ones, each with its checkpoint group's
scale, as int4.rank_group_size does for dense layers). `finish_int4_experts` keeps the
packed codes ([E, N, K / 8], `w13_int4_qweight`) and drops zero points that are all 8; on the
CPU (unless RADIXSERVE_INT4_CPU=packed) it dequantises both stacks into FusedMoE's
plain `w13_weight` / `w2_weight` instead. The fused Triton kernels take the packed stacks and
unpack each tile in registers (kernels/fused_moe.py). Act-order experts (a permutation per
expert) and experts stored all in one tensor are refused.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from radixserve.layers.quantization import int4_linear
from radixserve.layers.quantization.int4 import (MIN_RANK_GROUP, PACK, Int4Config,
                                                 check_weight_shape, checkpoint_rows,
                                                 dequantize_packed, drop_symmetric_zeros,
                                                 rank_group_columns, rank_group_size)

if TYPE_CHECKING:
    from radixserve.layers.moe.experts import FusedMoE


class Int4ExpertStacks(NamedTuple):
    """What the fused kernels take besides the packed codes: scales and zero points (or None)
    of both stacks, and each stack's input features per group."""
    w13_scales: torch.Tensor
    w13_zeros: torch.Tensor | None
    w2_scales: torch.Tensor
    w2_zeros: torch.Tensor | None
    w13_group_k: int
    w2_group_k: int


def _stack_shapes(moe: "FusedMoE") -> dict[str, tuple[int, int, int]]:
    """stack -> (rows on this rank, input features on this rank, checkpoint input features)."""
    size = moe.intermediate_size
    return {"w13": (2 * size, moe.hidden_size, moe.hidden_size),
            "w2": (moe.hidden_size, size, size * moe.tp_size)}


def add_int4_expert_params(moe: "FusedMoE", config: Int4Config) -> None:
    if config.act_order:
        raise ValueError("int4 act-order (desc_act) experts are not supported: each expert "
                         "would need its own permutation of the activations")
    names = config.names
    moe.int4_group_k, moe.int4_checkpoint_group = {}, {}
    for stack, (rows, k_rank, k_full) in _stack_shapes(moe).items():
        if k_rank % MIN_RANK_GROUP:
            raise ValueError(f"int4 experts: {k_rank} input features of {stack} on each rank "
                             f"(the fused kernels step through multiples of {MIN_RANK_GROUP}); "
                             "choose another --tp-size")
        group = config.group_of(k_full)
        moe.int4_checkpoint_group[stack] = group
        # a down projection split inside groups keeps finer ones (int4.rank_group_size)
        moe.int4_group_k[stack] = k_rank if config.group_size == -1 else \
            rank_group_size(k_rank, group)
        groups = k_rank // moe.int4_group_k[stack]
        pieces = ("w2",) if stack == "w2" else ("w1", "w3")
        specs = [("codes", (rows, k_rank // PACK), torch.int32),
                 ("scales", (rows, groups), None)]
        if not config.symmetric:
            specs.append(("zeros", (rows, groups), torch.uint8))
        for kind, shape, dtype in specs:
            param = nn.Parameter(torch.zeros(moe.num_experts, *shape, dtype=dtype),
                                 requires_grad=False)
            param.weight_loader = functools.partial(load_int4_piece, moe, kind)  # type: ignore
            param.expected_shards = {(e, p) for e in range(moe.num_experts)  # type: ignore
                                     for p in pieces}
            param.keep_dtype = dtype is not None  # type: ignore[attr-defined]
            setattr(moe, f"{stack}_{names[kind]}", param)
        # GPTQ tools that save a bias for every linear save zeros for experts (checked)
        bias = nn.Parameter(torch.zeros(moe.num_experts, rows), requires_grad=False)
        bias.weight_loader = functools.partial(load_int4_piece, moe, "bias")  # type: ignore
        bias.optional = True  # type: ignore[attr-defined]
        setattr(moe, f"{stack}_bias", bias)
        # all experts in one tensor (`experts.gate_up_proj`) names the plain stack: refused
        stacked = nn.Parameter(torch.zeros(0), requires_grad=False)
        stacked.weight_loader = functools.partial(load_int4_piece, moe, "stacked")  # type: ignore
        stacked.optional = True  # type: ignore[attr-defined]
        setattr(moe, f"{stack}_weight", stacked)
        for extra, kind in ((names["g_idx"], "g_idx"), ("weight_shape", "shape")):
            if config.method == "compressed-tensors" or kind == "g_idx":
                param = nn.Parameter(torch.zeros(0), requires_grad=False)
                param.weight_loader = functools.partial(load_int4_piece, moe,  # type: ignore
                                                        kind)
                param.optional = True  # type: ignore[attr-defined]
                setattr(moe, f"{stack}_{extra}", param)


def _drop_stack_params(moe: "FusedMoE", stack: str) -> None:
    """Remove one stack's loading-time int4 parameters (and its placeholders)."""
    assert moe.int4 is not None
    for name in (*moe.int4.names.values(), "weight_shape", "bias", "weight"):
        if hasattr(moe, f"{stack}_{name}"):
            delattr(moe, f"{stack}_{name}")


def drop_int4_expert_params(moe: "FusedMoE") -> None:
    """Remove the int4 stacks' parameters (the checkpoint leaves these experts unquantised)."""
    for stack in ("w13", "w2"):
        _drop_stack_params(moe, stack)
    moe.int4 = None


def load_int4_piece(moe: "FusedMoE", kind: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: object = None) -> None:
    """One expert's codes / scales / zeros of one piece, turned to [rows, columns] and placed
    as its bf16 weight would be; its g_idx and weight_shape only checked."""
    config = moe.int4
    assert config is not None and isinstance(shard_id, tuple)
    expert, piece = shard_id
    if expert in ("all", "all_inputs_first") or kind == "stacked":
        raise ValueError("int4 experts stored all in one tensor are not supported")
    stack = "w2" if piece == "w2" else "w13"
    rows_rank, k_rank, k_full = _stack_shapes(moe)[stack]
    full_rows = moe.hidden_size if piece == "w2" else rows_rank // 2 * moe.tp_size
    group = moe.int4_checkpoint_group[stack]
    if kind == "g_idx":
        if not torch.equal(loaded.long().cpu(), torch.arange(k_full) // group):
            raise ValueError("int4 act-order (desc_act) experts are not supported")
        return
    if kind == "bias":
        if bool(loaded.any()):
            raise ValueError("int4 experts with biases are not supported")
        return
    if kind == "shape":
        check_weight_shape(loaded, full_rows, k_full)
        return
    rows = checkpoint_rows(config, kind, loaded, full_rows)
    columns = k_full // (PACK if kind == "codes" else group)
    if tuple(rows.shape) != (full_rows, columns):
        raise ValueError(f"expert {expert} {piece} {kind} of shape {tuple(rows.shape)} "
                         f"(unpacked), expected {(full_rows, columns)}")
    size, rank = moe.intermediate_size, moe.tp_rank
    if piece == "w2":  # input features split: this rank's words, and its groups' scales
        if kind == "codes":
            part_cols = columns // moe.tp_size
            param.data[expert].copy_(rows.narrow(1, rank * part_cols, part_cols))
        elif config.group_size == -1:  # per channel: one group, whole
            param.data[expert].copy_(rows)
        else:
            param.data[expert].copy_(rows[:, rank_group_columns(
                rank * k_rank, k_rank, moe.int4_group_k[stack], group, rows.device)])
    else:
        target = param.data[expert].narrow(0, 0 if piece == "w1" else size, size)
        target.copy_(rows.narrow(0, rank * size, size))


def finish_int4_experts(moe: "FusedMoE") -> None:
    """Pack both stacks, or dequantise them into plain weights on the CPU."""
    config = moe.int4
    if config is None:
        return
    names = config.names
    dense = next(iter(moe.parameters())).device.type == "cpu" and \
        not int4_linear.PACKED_ON_CPU
    for stack in ("w13", "w2"):
        packed = getattr(moe, f"{stack}_{names['codes']}").data
        scales = getattr(moe, f"{stack}_{names['scales']}").data
        zeros_param = getattr(moe, f"{stack}_{names['zeros']}", None)
        zeros = drop_symmetric_zeros(None if zeros_param is None else zeros_param.data)
        _drop_stack_params(moe, stack)
        if dense:
            group = moe.int4_group_k[stack]
            weight = torch.stack([dequantize_packed(packed[e], scales[e],
                                                    None if zeros is None else zeros[e],
                                                    group, scales.dtype)
                                  for e in range(packed.shape[0])])
            setattr(moe, f"{stack}_weight", nn.Parameter(weight, requires_grad=False))
            continue
        setattr(moe, f"{stack}_int4_qweight", int4_linear._runtime(packed))
        setattr(moe, f"{stack}_int4_scales", nn.Parameter(scales, requires_grad=False))
        setattr(moe, f"{stack}_int4_zeros",
                None if zeros is None else int4_linear._runtime(zeros.contiguous()))
    if dense:
        moe.int4 = None


def int4_stacks(moe: "FusedMoE") -> Int4ExpertStacks:
    return Int4ExpertStacks(moe.w13_int4_scales, moe.w13_int4_zeros, moe.w2_int4_scales,
                            moe.w2_int4_zeros, moe.int4_group_k["w13"], moe.int4_group_k["w2"])


def int4_expert_weights(moe: "FusedMoE", expert: int, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's gate|up and down dequantised from the packed stacks (reference path)."""
    out = []
    for stack in ("w13", "w2"):
        zeros = getattr(moe, f"{stack}_int4_zeros")
        out.append(dequantize_packed(getattr(moe, f"{stack}_int4_qweight")[expert],
                                     getattr(moe, f"{stack}_int4_scales")[expert],
                                     None if zeros is None else zeros[expert],
                                     moe.int4_group_k[stack], dtype))
    return out[0], out[1]
