"""Int4 layers under tensor parallelism: every rank's product equals its slice of the
checkpoint's dequantised layer (tp 1's), for row-parallel layers (scales split with their
groups; act-order ranks keep every group's scale and are dequantised), merged column-parallel
pieces (act-order: the permutation shared by the pieces), q|k|v with replicated KV heads, in
both the CPU's dense form and the GPU's packed form; splits that cut groups are refused."""
from __future__ import annotations

import pytest
import torch

from radixserve.layers.linear import RowParallelLinear
from radixserve.layers.merged_linear import MergedColumnParallelLinear, QKVParallelLinear
from radixserve.layers.quantization import int4_linear
from radixserve.layers.quantization.int4 import int4_config, int4_linears
from tests.layers.test_fp8_tp_scales import _Group
from tests.models.int4_checkpoints import (awq_tensors, ct_tensors, dequantized,
                                           fake_quantize, gptq_tensors)

GPTQ_ACT = int4_config({"quant_method": "gptq", "bits": 4, "group_size": 16,
                        "desc_act": True, "sym": True}, None)
AWQ = int4_config({"quant_method": "awq", "bits": 4, "group_size": 16}, None)
CT = int4_config({"quant_method": "compressed-tensors", "format": "pack-quantized",
                  "config_groups": {"g": {"targets": ["Linear"], "weights": {
                      "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                      "group_size": 16}}}}, None)
CONFIGS = {"awq": AWQ, "gptq": GPTQ_ACT, "compressed-tensors": CT}


def _checkpoint(n: int, k: int, method: str, act_order: bool, seed: int,
                order_seed: int | None = None, group: int = 16):
    """A layer's checkpoint tensors, dequantised weight and g_idx; act-order: the features'
    groups in an order drawn from order_seed (default: seed)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.1
    g_idx = torch.arange(k) // group
    if act_order:
        order = torch.Generator().manual_seed(seed if order_seed is None else order_seed)
        g_idx = g_idx[torch.randperm(k, generator=order)]
    codes, scales, zeros = fake_quantize(w, g_idx, k // group, symmetric=method == "gptq")
    if method == "gptq":
        tensors = gptq_tensors(codes, scales, zeros, g_idx)
    elif method == "awq":
        tensors = awq_tensors(codes, scales, zeros)
    else:
        tensors = ct_tensors(codes, scales, zeros, g_idx, symmetric=False, act_order=act_order)
    return tensors, dequantized(codes, scales, zeros, g_idx), g_idx


def _load(layer, tensors: dict, shard_id=None) -> None:
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor, *(() if shard_id is None else (shard_id,)))


def _check(layer, x: torch.Tensor, want: torch.Tensor) -> None:
    layer.finish_loading()
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-4)


@pytest.fixture(params=["dense", "packed"])
def form(request, monkeypatch):
    monkeypatch.setattr(int4_linear, "PACKED_ON_CPU", request.param == "packed")
    return request.param


@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", True),
                                              ("compressed-tensors", False)])
def test_row_parallel_ranks_compute_their_slice(method, act_order, form) -> None:
    tensors, dense, _ = _checkpoint(24, 64, method, act_order, 0)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    tensors.pop("bias", None)
    for rank in range(2):
        with int4_linears(CONFIGS[method]):
            layer = RowParallelLinear(64, 24, tp_rank=rank, tp_size=2, reduce_results=False)
        _load(layer, tensors)
        part = slice(rank * 32, rank * 32 + 32)
        _check(layer, x[:, part], x[:, part] @ dense[:, part].t())
        if act_order:  # features of every group on each rank: dequantised after loading
            assert layer.int4 is None and layer.weight.shape == (24, 32)


@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", True)])
def test_merged_pieces_share_the_input_order(method, act_order, form) -> None:
    # gate and up read one input: GPTQ ordered both the same way
    (gate, gate_w, _), (up, up_w, _) = [_checkpoint(32, 48, method, act_order, s, order_seed=9)
                                        for s in (2, 3)]
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(4))
    for rank in range(2):
        with int4_linears(CONFIGS[method]):
            layer = MergedColumnParallelLinear(48, [32, 32], tp_rank=rank, tp_size=2)
        _load(layer, gate, 0)
        _load(layer, up, 1)
        rows = slice(rank * 16, rank * 16 + 16)
        want = torch.cat([x @ gate_w[rows].t(), x @ up_w[rows].t()], dim=1)
        _check(layer, x, want)
        if form == "packed":
            assert layer.int4 is not None and (layer.int4_perm is not None) == act_order


def test_act_order_ranks_holding_whole_groups_stay_packed(monkeypatch) -> None:
    """Act-order whose groups each fall on one rank (each rank's features a permutation of
    whole groups): the ranks keep their own groups' scales and stay int4."""
    monkeypatch.setattr(int4_linear, "PACKED_ON_CPU", True)
    gen = torch.Generator().manual_seed(11)
    g_idx = torch.cat([torch.randperm(32, generator=gen) // 16,
                       torch.randperm(32, generator=gen) // 16 + 2])
    w = torch.randn(24, 64, generator=gen) * 0.1
    codes, scales, zeros = fake_quantize(w, g_idx, 4, symmetric=True)
    tensors = gptq_tensors(codes, scales, zeros, g_idx)
    tensors.pop("bias")
    dense = dequantized(codes, scales, zeros, g_idx)
    x = torch.randn(3, 64, generator=gen)
    for rank in range(2):
        with int4_linears(GPTQ_ACT):
            layer = RowParallelLinear(64, 24, tp_rank=rank, tp_size=2, reduce_results=False)
        _load(layer, tensors)
        part = slice(rank * 32, rank * 32 + 32)
        _check(layer, x[:, part], x[:, part] @ dense[:, part].t())
        assert layer.int4 is not None and layer.int4_scales.shape == (24, 2)


def test_pieces_quantised_in_different_orders_are_refused() -> None:
    gate, _, _ = _checkpoint(32, 48, "gptq", True, 2)
    up, _, _ = _checkpoint(32, 48, "gptq", True, 3)
    with int4_linears(GPTQ_ACT):
        layer = MergedColumnParallelLinear(48, [32, 32], tp_rank=0, tp_size=1)
    _load(layer, gate, 0)
    with pytest.raises(ValueError, match="different input orders"):
        _load(layer, up, 1)


def test_qkv_with_replicated_kv_heads(form) -> None:
    """4 query heads and 1 KV head of 16 over 2 ranks: each rank loads the one KV head."""
    pieces = {p: _checkpoint(rows, 64, "awq", False, s)
              for p, rows, s in (("q", 64, 5), ("k", 16, 6), ("v", 16, 7))}
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(8))
    for rank in range(2):
        with int4_linears(AWQ):
            layer = QKVParallelLinear(64, 16, 4, 1, tp_rank=rank, tp_size=2)
        for piece, (tensors, _, _) in pieces.items():
            _load(layer, tensors, piece)
        q_rows = slice(rank * 32, rank * 32 + 32)
        want = torch.cat([x @ pieces["q"][1][q_rows].t(), x @ pieces["k"][1].t(),
                          x @ pieces["v"][1].t()], dim=1)
        _check(layer, x, want)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_ranks_splitting_groups_keep_finer_ones(method, form) -> None:
    """Groups of 32 over 96 features at tp 2: 48 a rank, so each rank keeps groups of 16,
    each with its checkpoint group's scale and zero point (GPTQ: its trivial g_idx too)."""
    config = int4_config({"quant_method": method, "bits": 4, "group_size": 32,
                          "desc_act": False, "sym": False}, None)
    tensors, dense, _ = _checkpoint(24, 96, method, False, 3, group=32)
    tensors.pop("bias", None)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(4))
    for rank in range(2):
        with int4_linears(config):
            layer = RowParallelLinear(96, 24, tp_rank=rank, tp_size=2, reduce_results=False)
        assert layer.int4_group == 16
        _load(layer, tensors)
        part = slice(rank * 48, rank * 48 + 48)
        _check(layer, x[:, part], x[:, part] @ dense[:, part].t())


def test_splits_that_cut_groups_too_fine_are_refused() -> None:
    with int4_linears(AWQ), pytest.raises(ValueError, match="cuts the groups into pieces of 8"):
        RowParallelLinear(48, 16, tp_rank=0, tp_size=2)  # 24 features a rank, groups of 16


def test_the_decode_mlp_kernel_steps_aside_for_int4_layers(monkeypatch) -> None:
    """GatedMLP's one-launch decode MLP reads bf16 weights: with int4 layers (packed form, as
    on a GPU) its check must not touch them, and the MLP runs its products."""
    from radixserve.models import blocks
    monkeypatch.setattr(int4_linear, "PACKED_ON_CPU", True)
    monkeypatch.setattr(blocks, "one_row_kernels_apply", lambda rows: True)
    with int4_linears(AWQ):
        mlp = blocks.GatedMLP(48, 32)
    (gate, gate_w, _), (up, up_w, _) = [_checkpoint(32, 48, "awq", False, s) for s in (2, 3)]
    down, down_w, _ = _checkpoint(48, 32, "awq", False, 4)
    _load(mlp.gate_up_proj, gate, 0)
    _load(mlp.gate_up_proj, up, 1)
    _load(mlp.down_proj, down)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.finish_loading()
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(5))
    want = (torch.nn.functional.silu(x @ gate_w.t()) * (x @ up_w.t())) @ down_w.t()
    torch.testing.assert_close(mlp(x), want, atol=1e-4, rtol=1e-4)


def test_codes_load_packed_so_loading_stays_within_the_int4_footprint() -> None:
    """Before loading, a layer's codes are int32 words of eight (no unpacked staging copy)."""
    with int4_linears(AWQ):
        layer = RowParallelLinear(64, 24, tp_rank=1, tp_size=2)
    assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (24, 4)
    assert layer.scales.shape == (24, 2) and layer.qzeros.dtype == torch.uint8


@pytest.mark.parametrize("method", ["awq", "compressed-tensors"])
def test_expert_down_projections_split_inside_groups(method, form, monkeypatch) -> None:
    """Experts of 96 intermediate features, groups of 32, at tp 2: each rank's down
    projection keeps groups of 16; both stacks of each rank dequantise to its slice."""
    from radixserve.layers.moe import experts as experts_module
    config = int4_config({"quant_method": "awq", "bits": 4, "group_size": 32}, None) \
        if method == "awq" else CT
    group = 32 if method == "awq" else 16
    hidden, inter, tp_size = 64, 96, 2
    pieces = {"w1": _checkpoint(inter, hidden, method, False, 20, group=group),
              "w3": _checkpoint(inter, hidden, method, False, 21, group=group),
              "w2": _checkpoint(hidden, inter, method, False, 22, group=group)}
    size = inter // tp_size
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(5))
    for rank in range(tp_size):
        monkeypatch.setattr(experts_module, "get_tp_group", lambda: _Group(rank, tp_size))
        with int4_linears(config):
            moe = experts_module.FusedMoE(1, hidden, inter)
        for piece, (tensors, _, _) in pieces.items():
            stack = "w2" if piece == "w2" else "w13"
            for name, tensor in tensors.items():
                if name == "weight_shape":
                    continue
                param = getattr(moe, f"{stack}_{name}")
                param.weight_loader(param, tensor, (0, piece))
        moe.finish_loading()
        w13, w2 = moe._expert_weights(0, torch.float32)
        rows = slice(rank * size, (rank + 1) * size)
        want13 = torch.cat((pieces["w1"][1][rows], pieces["w3"][1][rows]))
        torch.testing.assert_close(x @ w13.t(), x @ want13.t(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w2, pieces["w2"][1][:, rows], atol=1e-6, rtol=1e-6)
