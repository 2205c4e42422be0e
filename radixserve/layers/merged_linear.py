"""Linears whose weight stacks several checkpoint tensors along the output dim, each loaded
as its own piece (its shard id) and split over the ranks piece by piece: gate|up
(`MergedColumnParallelLinear`) and attention's q|k|v (`QKVParallelLinear`, split by heads,
KV heads replicated when there are fewer than ranks). A checkpoint that stores all the pieces
in one tensor (Phi-3) loads it with the shard id ALL_PIECES."""
from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.linear import (ColumnParallelLinear, LinearBase, _rank_and_size, _shard,
                                      default_weight_loader)


# the shard id of a checkpoint tensor holding every piece of a merged layer, stacked in the
# layer's order (Phi-3's qkv_proj and gate_up_proj): the loaders split it into its pieces
ALL_PIECES = "all_pieces"


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several checkpoint weights stacked along the output dim (gate|up): `shard_id` is the
    index of the piece in `output_sizes` (full sizes, before the rank split), or ALL_PIECES
    for one tensor holding them all."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def full_rows(self, shard_id: object = None) -> int:
        if shard_id == ALL_PIECES:
            return sum(self.output_sizes)
        return self.output_sizes[shard_id]  # type: ignore[index]

    def _piece(self, shard_id: int) -> tuple[int, int]:
        """(offset, size) of a piece in this rank's merged weight."""
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        return offset, self.output_sizes[shard_id] // self.tp_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> set[object] | None:
        if shard_id == ALL_PIECES:
            return _load_pieces(self, param, loaded,
                                dict(enumerate(self.output_sizes)))  # type: ignore[arg-type]
        if shard_id is None:  # a checkpoint that stores the pieces merged already
            raise ValueError("merged layers load their pieces one by one (give a shard_id)")
        offset, size = self._piece(shard_id)  # type: ignore[arg-type]
        if loaded.shape[0] != self.output_sizes[shard_id]:  # type: ignore[index]
            raise ValueError(f"piece {shard_id} of {loaded.shape[0]} rows, expected "
                             f"{self.output_sizes[shard_id]}")  # type: ignore[index]
        default_weight_loader(param.data.narrow(0, offset, size),  # type: ignore[arg-type]
                              _shard(loaded, 0, self.tp_rank, self.tp_size))


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v of attention, split by heads over the ranks; KV heads are replicated (each rank
    loads the KV head its query heads use) when there are fewer KV heads than ranks.
    `shard_id` is "q", "k" or "v". `q_rows_per_head` (default head_dim): a query head's rows in
    the q projection, 2 x head_dim where each head's query is followed by its output gate
    (Qwen3-Next's gated attention)."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, tp_rank: int | None = None,
                 tp_size: int | None = None, q_rows_per_head: int | None = None) -> None:
        tp_rank, tp_size = _rank_and_size(tp_rank, tp_size)
        if total_num_heads % tp_size:
            raise ValueError(f"{total_num_heads} heads do not split over {tp_size} ranks")
        if total_num_kv_heads >= tp_size and total_num_kv_heads % tp_size:
            raise ValueError(f"{total_num_kv_heads} KV heads do not split over {tp_size} ranks")
        if total_num_kv_heads < tp_size and tp_size % total_num_kv_heads:
            raise ValueError(f"{tp_size} ranks cannot share {total_num_kv_heads} KV heads evenly")
        self.head_dim = head_dim
        self.q_rows_per_head = q_rows_per_head or head_dim
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        self.total_num_kv_heads = total_num_kv_heads
        self.q_size = self.num_heads * self.q_rows_per_head
        self.kv_size = self.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias,
                            tp_rank, tp_size)

    def full_rows(self, shard_id: object = None) -> int:
        if shard_id == ALL_PIECES:
            return self.full_rows("q") + 2 * self.full_rows("k")
        if shard_id == "q":
            return self.num_heads * self.tp_size * self.q_rows_per_head
        return self.total_num_kv_heads * self.head_dim

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    @property
    def kv_head_replicas(self) -> int:
        """Ranks holding each KV head: tp_size / total KV heads apart share one when there
        are fewer KV heads than ranks, else 1."""
        return max(1, self.tp_size // self.total_num_kv_heads)

    def first_head(self, shard_id: str) -> int:
        """The checkpoint's first head of this rank's q ("q") or k / v heads."""
        if shard_id == "q":
            return self.tp_rank * self.num_heads
        return (self.tp_rank // self.kv_head_replicas) * self.num_kv_heads

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> set[object] | None:
        if shard_id == ALL_PIECES:
            return _load_pieces(self, param, loaded, {piece: self.full_rows(piece)
                                                      for piece in ("q", "k", "v")})
        head_rows = self.q_rows_per_head if shard_id == "q" else self.head_dim
        if shard_id == "q":
            offset, size = 0, self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size = self.kv_size
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        head_index = self.first_head(shard_id)
        total_heads = self.num_heads * self.tp_size if shard_id == "q" else self.total_num_kv_heads
        if loaded.shape[0] != total_heads * head_rows:
            raise ValueError(f"{shard_id} projection of {loaded.shape[0]} rows, expected "
                             f"{total_heads} heads x {head_rows}")
        rows = loaded.narrow(0, head_index * head_rows, size)
        default_weight_loader(param.data.narrow(0, offset, size), rows)  # type: ignore[arg-type]


def _load_pieces(layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor,
                 rows: dict[object, int]) -> set[object]:
    """A tensor holding every piece of a merged layer (ALL_PIECES), stacked in `rows`' order
    (piece -> its full rows), loaded piece by piece through the layer's own loader; the pieces
    it covered, for the loader's check."""
    if loaded.shape[0] != sum(rows.values()):
        raise ValueError(f"merged pieces of {loaded.shape[0]} rows, expected "
                         f"{sum(rows.values())}")
    start = 0
    for piece, size in rows.items():
        layer.weight_loader(param, loaded.narrow(0, start, size), piece)
        start += size
    return set(rows)
