"""Per-parameter weight loaders and the generic loader: merged q|k|v and gate|up pieces land at
their offsets, tensor-parallel ranks take their shards (KV heads replicated past their count),
and a checkpoint that does not fit is an error naming the tensor."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from radixserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from radixserve.layers.merged_linear import MergedColumnParallelLinear, QKVParallelLinear
from radixserve.loader.weight_loading import load_weights

HIDDEN, HEAD_DIM = 8, 2


def _qkv_weights(num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    """Row r of each tensor holds value (base + r) so every row says where it came from."""
    return {"q": 100 + torch.arange(num_heads * HEAD_DIM).float()[:, None].expand(-1, HIDDEN),
            "k": 200 + torch.arange(num_kv_heads * HEAD_DIM).float()[:, None].expand(-1, HIDDEN),
            "v": 300 + torch.arange(num_kv_heads * HEAD_DIM).float()[:, None].expand(-1, HIDDEN)}


@pytest.mark.parametrize("num_heads, num_kv_heads, tp_size", [
    (4, 2, 1), (4, 2, 2), (8, 2, 4), (4, 1, 2), (8, 2, 8)])
def test_qkv_shards_by_heads_and_replicates_kv_heads(num_heads: int, num_kv_heads: int,
                                                     tp_size: int) -> None:
    weights = _qkv_weights(num_heads, num_kv_heads)
    for rank in range(tp_size):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, num_heads, num_kv_heads, tp_rank=rank,
                                  tp_size=tp_size)
        for shard_id, tensor in weights.items():
            layer.weight.weight_loader(layer.weight, tensor, shard_id)
        q, k, v = layer.split(layer.weight[:, 0])
        heads = num_heads // tp_size
        assert torch.equal(q, weights["q"][rank * heads * HEAD_DIM:(rank + 1) * heads * HEAD_DIM, 0])
        kv_head = rank * num_kv_heads // tp_size if num_kv_heads >= tp_size else \
            rank // (tp_size // num_kv_heads)
        kv_heads = max(1, num_kv_heads // tp_size)
        rows = slice(kv_head * HEAD_DIM, (kv_head + kv_heads) * HEAD_DIM)
        assert torch.equal(k, weights["k"][rows, 0]) and torch.equal(v, weights["v"][rows, 0])


def test_merged_column_and_row_parallel_shards() -> None:
    gate, up = torch.randn(6, HIDDEN), torch.randn(6, HIDDEN)
    down = torch.randn(HIDDEN, 6)
    for rank in range(2):
        merged = MergedColumnParallelLinear(HIDDEN, [6, 6], tp_rank=rank, tp_size=2)
        merged.weight.weight_loader(merged.weight, gate, 0)
        merged.weight.weight_loader(merged.weight, up, 1)
        assert torch.equal(merged.weight, torch.cat((gate[rank * 3:rank * 3 + 3],
                                                     up[rank * 3:rank * 3 + 3])))
        row = RowParallelLinear(6, HIDDEN, bias=True, tp_rank=rank, tp_size=2)
        row.weight.weight_loader(row.weight, down)
        row.bias.weight_loader(row.bias, torch.ones(HIDDEN))  # the bias stays whole
        assert torch.equal(row.weight, down[:, rank * 3:rank * 3 + 3])
    column = ColumnParallelLinear(HIDDEN, 6, tp_rank=1, tp_size=3)
    column.weight.weight_loader(column.weight, gate)
    assert torch.equal(column.weight, gate[2:4])
    with pytest.raises(ValueError, match="split"):
        ColumnParallelLinear(HIDDEN, 7, tp_size=2)


class _Tiny(nn.Module):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                              "v_proj": ("qkv_proj", "v")}

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, 4, 2)
        self.norm = nn.Parameter(torch.zeros(HIDDEN))

    def skip_weight(self, name: str) -> bool:
        return name.endswith("inv_freq")


def _checkpoint() -> dict[str, torch.Tensor]:
    weights = _qkv_weights(4, 2)
    return {"attn.q_proj.weight": weights["q"], "attn.k_proj.weight": weights["k"],
            "attn.v_proj.weight": weights["v"], "norm": torch.ones(HIDDEN),
            "rotary.inv_freq": torch.ones(3)}


def test_generic_loader_fills_every_parameter() -> None:
    model = _Tiny()
    load_weights(model, _checkpoint().items())
    assert torch.equal(model.norm, torch.ones(HIDDEN))
    assert torch.equal(model.attn.qkv_proj.weight[:, 0],
                       torch.cat([w[:, 0] for w in _qkv_weights(4, 2).values()]))


@pytest.mark.parametrize("change, message", [
    (lambda ckpt: ckpt.pop("norm"), "lacks 1 tensors"),
    (lambda ckpt: ckpt.pop("attn.v_proj.weight"), "misses \\['v'\\]"),
    (lambda ckpt: ckpt.update({"extra.weight": torch.ones(1)}), "'extra.weight' has no place"),
    (lambda ckpt: ckpt.update({"norm": torch.ones(HIDDEN + 1)}), "norm: checkpoint tensor"),
    (lambda ckpt: ckpt.update({"attn.k_proj.weight": torch.ones(2, HIDDEN)}), "k_proj"),
    # a merged parameter named by the checkpoint tensors it is made of
    (lambda ckpt: [ckpt.pop(f"attn.{p}_proj.weight") for p in "qkv"],
     "lacks 1 tensors, e.g. \\['attn.{k_proj,q_proj,v_proj}.weight'\\]"),
])
def test_generic_loader_refuses_a_checkpoint_that_does_not_fit(change, message: str) -> None:
    """One CheckpointError (a ValueError, shown without a traceback) naming the tensor."""
    from radixserve.loader.checkpoint_error import CheckpointError
    ckpt = _checkpoint()
    change(ckpt)
    with pytest.raises(CheckpointError, match=message):
        load_weights(_Tiny(), ckpt.items())


def test_loading_shows_a_progress_bar_on_a_terminal_only(monkeypatch, capsys) -> None:
    import sys
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    load_weights(_Tiny(), _checkpoint().items())
    assert "loading weights" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    load_weights(_Tiny(), _checkpoint().items())
    assert "loading weights" in capsys.readouterr().err
