"""Checkpoints whose rope rotates adjacent pairs (x[2i], x[2i+1]) (Meta's Llama-4 layout,
Cohere's), served by kernels that rotate halves (x[i], x[i + D/2]): each head's q and k rows
are permuted at load, pairs to halves. q . k is unchanged, as both are permuted alike; v and o
are untouched (what Hugging Face's conversion of Meta's Llama checkpoints did). Anything applied
to q or k per feature after the projection (a per-head norm's weight) is permuted the same way.
"""
from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.merged_linear import QKVParallelLinear


def pair_order(head_dim: int) -> torch.Tensor:
    """A head's features in the halves layout, as indices of the pairs layout: 0, 2, 4, ...,
    then 1, 3, 5, ..."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def pairs_to_halves(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Each head's rows (dim 0) reordered from pairs (2i, 2i + 1) to halves (i, i + D/2):
    rows 0, 2, 4, ..., then 1, 3, 5, ... of every head_dim-row head."""
    order = pair_order(head_dim)
    heads = rows.shape[0] // head_dim
    index = (order[None, :] + head_dim * torch.arange(heads)[:, None]).reshape(-1)
    data = rows.view(torch.uint8) if rows.element_size() == 1 else rows  # FP8 codes
    moved = data.index_select(0, index.to(rows.device))
    return moved.view(rows.dtype) if rows.element_size() == 1 else moved


class RopePairsQKV(QKVParallelLinear):
    """q|k|v of a checkpoint whose rope rotates adjacent pairs: q's and k's rows (weights, a
    bias, FP8 scales expanded to rows, LoRA B) reach the usual loader permuted per head by
    `pairs_to_halves`."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> set[object] | None:
        if shard_id in ("q", "k"):
            loaded = pairs_to_halves(loaded, self.head_dim)
        return super().weight_loader(param, loaded, shard_id)
