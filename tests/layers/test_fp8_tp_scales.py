"""FP8 scales under tensor parallelism: every rank's dequantised weight is exactly its slice of
the checkpoint's dequantised weight (tp 1's), for block scales, including splits of the input
columns that fall inside a block (Qwen3-30B-A3B's 768 expert columns over 4 ranks against
blocks of 128), where each rank keeps finer scale groups, and for --quantization fp8, whose
per-row scales come from the checkpoint's whole rows; splits finer than the kernels' narrowest
group are refused with a message that names the fix."""
from __future__ import annotations

import pytest
import torch

from radixserve.layers.linear import RowParallelLinear
from radixserve.layers.merged_linear import MergedColumnParallelLinear
from radixserve.layers.moe import experts as experts_module
from radixserve.layers.quantization.fp8 import (FP8_DTYPE, Fp8Config, dequantize_weight,
                                                fp8_linears, rank_group_k)

FP8_MAX = 448.0


def _block_checkpoint(rows: int, cols: int, block: int, seed: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [rows, cols], block scales [cdiv(rows, block), cdiv(cols, block)], the weight
    they stand for), with scales that differ from block to block."""
    gen = torch.Generator().manual_seed(seed)
    grid = (-(-rows // block), -(-cols // block))
    scale = torch.rand(grid, generator=gen) * 0.01 + 0.001
    codes = (torch.randn(rows, cols, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    expanded = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return codes, scale, codes.float() * expanded


def _rank_weight(layer) -> torch.Tensor:
    return dequantize_weight(layer.weight, layer.weight_scale, layer.group_k, torch.float32)


@pytest.mark.parametrize("cols, block, tp_size, group", [
    (768, 128, 4, 64),    # Qwen3-30B-A3B's expert columns at tp 4: 192 a rank
    (768, 128, 8, 32),    # ... at tp 8: 96 a rank
    (224, 32, 2, 16),     # 7 blocks over 2 ranks (the groups' count splits, the blocks do not)
    (256, 128, 2, 128),   # on block boundaries: the checkpoint's groups
])
def test_row_parallel_ranks_hold_their_slice_of_the_weight(cols: int, block: int,
                                                           tp_size: int, group: int) -> None:
    codes, scale, weight = _block_checkpoint(48, cols, block, seed=cols + tp_size)
    k_rank = cols // tp_size
    with fp8_linears(Fp8Config(block=block)):
        for rank in range(tp_size):
            layer = RowParallelLinear(cols, 48, tp_rank=rank, tp_size=tp_size)
            assert layer.group_k == group
            layer.weight.weight_loader(layer.weight, codes)
            layer.weight_scale.weight_loader(layer.weight_scale, scale)
            torch.testing.assert_close(_rank_weight(layer),
                                       weight[:, rank * k_rank:(rank + 1) * k_rank],
                                       rtol=0, atol=0)


def test_merged_column_pieces_keep_the_checkpoint_blocks() -> None:
    """gate|up over tp 4 at 96 rows a piece a rank: rows split inside blocks, columns whole."""
    pieces = [_block_checkpoint(384, 256, 128, seed=s) for s in (1, 2)]
    with fp8_linears(Fp8Config(block=128)):
        for rank in range(4):
            layer = MergedColumnParallelLinear(256, [384, 384], tp_rank=rank, tp_size=4)
            assert layer.group_k == 128
            for shard_id, (codes, scale, _) in enumerate(pieces):
                layer.weight.weight_loader(layer.weight, codes, shard_id)
                layer.weight_scale.weight_loader(layer.weight_scale, scale, shard_id)
            rows = slice(rank * 96, (rank + 1) * 96)
            torch.testing.assert_close(
                _rank_weight(layer), torch.cat([weight[rows] for _, _, weight in pieces]),
                rtol=0, atol=0)


class _Group:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


@pytest.mark.parametrize("tp_size, group", [(4, 64), (2, 128)])
def test_expert_down_projections_split_inside_blocks(monkeypatch, tp_size: int,
                                                     group: int) -> None:
    """Experts of 768 columns (Qwen3-30B-A3B) over tp ranks: both projections of each rank
    dequantise to its slice (gate and up by rows, down by columns)."""
    experts, hidden, inter = 2, 256, 768
    gate, up, down = (_block_checkpoint(inter, hidden, 128, seed=10),
                      _block_checkpoint(inter, hidden, 128, seed=11),
                      _block_checkpoint(hidden, inter, 128, seed=12))
    size = inter // tp_size
    for rank in range(tp_size):
        monkeypatch.setattr(experts_module, "get_tp_group", lambda: _Group(rank, tp_size))
        with fp8_linears(Fp8Config(block=128)):
            moe = experts_module.FusedMoE(experts, hidden, inter)
        assert moe.group_k == group
        for expert in range(experts):
            for piece, (codes, scale, _) in (("w1", gate), ("w3", up), ("w2", down)):
                param = moe.w2_weight if piece == "w2" else moe.w13_weight
                param.weight_loader(param, codes, (expert, piece))
                scales = moe.w2_weight_scale if piece == "w2" else moe.w13_weight_scale
                scales.weight_loader(scales, scale, (expert, piece))
            w13, w2 = moe._expert_weights(expert, torch.float32)
            rows = slice(rank * size, (rank + 1) * size)
            torch.testing.assert_close(w13, torch.cat((gate[2][rows], up[2][rows])),
                                       rtol=0, atol=0)
            torch.testing.assert_close(w2, down[2][:, rows], rtol=0, atol=0)


def test_online_quantization_scales_whole_rows_on_every_rank() -> None:
    weight = torch.randn(32, 96, generator=torch.Generator().manual_seed(3))
    weight[:, 0] *= 40  # each row's largest value sits in rank 0's columns
    with fp8_linears(Fp8Config(online=True)):
        whole = RowParallelLinear(96, 32, tp_rank=0, tp_size=1)
        whole.weight.weight_loader(whole.weight, weight)
        whole.finish_loading()
        for rank in range(2):
            layer = RowParallelLinear(96, 32, tp_rank=rank, tp_size=2)
            layer.weight.weight_loader(layer.weight, weight)
            layer.finish_loading()
            torch.testing.assert_close(_rank_weight(layer),
                                       _rank_weight(whole)[:, rank * 48:(rank + 1) * 48],
                                       rtol=0, atol=0)


def test_online_expert_down_projections_scale_whole_rows(monkeypatch) -> None:
    experts, hidden, inter = 2, 32, 64
    gen = torch.Generator().manual_seed(4)
    gate, up, down = (torch.randn(experts, *shape, generator=gen)
                      for shape in ((inter, hidden), (inter, hidden), (hidden, inter)))
    down[:, :, 0] *= 40  # each row's largest value sits in rank 0's columns

    def build(rank: int, size: int):
        monkeypatch.setattr(experts_module, "get_tp_group", lambda: _Group(rank, size))
        with fp8_linears(Fp8Config(online=True)):
            moe = experts_module.FusedMoE(experts, hidden, inter)
        for expert in range(experts):
            for piece, weight in (("w1", gate), ("w3", up), ("w2", down)):
                param = moe.w2_weight if piece == "w2" else moe.w13_weight
                param.weight_loader(param, weight[expert], (expert, piece))
        moe.finish_loading()
        return [moe._expert_weights(e, torch.float32)[1] for e in range(experts)]

    whole = build(0, 1)
    for rank in range(2):
        for got, want in zip(build(rank, 2), whole):
            torch.testing.assert_close(got, want[:, rank * 32:(rank + 1) * 32], rtol=0, atol=0)


def test_splits_finer_than_the_kernels_take_are_refused() -> None:
    with pytest.raises(ValueError, match="choose a --tp-size"):
        rank_group_k(128, 200, k_split=True)  # groups of 8
    with fp8_linears(Fp8Config(block=16)), pytest.raises(ValueError, match="groups of 8"):
        RowParallelLinear(48, 16, tp_rank=0, tp_size=2)
    assert rank_group_k(128, 200, k_split=False) == 128  # one rank: a partial last block
    assert rank_group_k(None, 200, k_split=True) is None  # per-channel scales
