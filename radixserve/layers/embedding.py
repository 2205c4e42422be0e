"""Vocab-parallel embedding and LM head: each tensor-parallel rank holds a contiguous range of
the vocabulary's rows.

The vocabulary is padded to a multiple of the rank count; rank r holds rows
[r * rows, (r + 1) * rows) with rows = padded / size (rows past the real vocabulary stay zero).
The embedding looks up the ids in its range, zeroes the others and sums over the ranks; the LM
head computes the logits of its range and gathers them, then drops the padding. With one rank
both are the plain operations.
"""
from __future__ import annotations

import torch
from torch import nn

from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.linear import linear, linear_into


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank, group.size
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # set where the weight is stored narrower than the compute dtype (layers/cpu_linear.py:
        # keep_checkpoint_dtype): looked-up rows are widened to it
        self.output_dtype: torch.dtype | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.num_embeddings, param.shape[1]):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a "
                             f"vocabulary of {self.num_embeddings} x {param.shape[1]}")
        rows = loaded[self.vocab_start:self.vocab_end]
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = self._lookup(local) * mine.unsqueeze(-1)
        return get_tp_group().all_reduce(out)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        rows = nn.functional.embedding(ids, self.weight)
        return rows if self.output_dtype is None else rows.to(self.output_dtype)


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head of an untied model: the same row split as the embedding, with an optional
    bias split alike (PhiMoE's)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.rows_per_rank), requires_grad=False)
            self.bias.weight_loader = self._bias_loader  # type: ignore[attr-defined]

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.num_embeddings,):
            raise ValueError(f"checkpoint LM head bias of shape {tuple(loaded.shape)}, "
                             f"expected ({self.num_embeddings},)")
        rows = loaded[self.vocab_start:self.vocab_end]
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an LM head is applied with project(), not looked up")


def project_to_vocab(hidden: torch.Tensor, head: VocabParallelEmbedding,
                     out: torch.Tensor | None = None, keep_dtype: bool = False) -> torch.Tensor:
    """Logits [T, vocab] over the whole vocabulary: this rank's range, gathered. float32, or
    with keep_dtype the product's own dtype (the compute dtype). With `out` ([>= T, vocab], of
    the result's dtype) they are written into its first T rows, which are returned; with one
    rank and keep_dtype the product writes them there itself (`linear_into`). The head's bias,
    where it has one, is added to this rank's range."""
    rows = hidden.shape[0]
    bias = getattr(head, "bias", None)
    if out is not None and keep_dtype and head.tp_size == 1:
        logits = linear_into(hidden, head.weight, out[:rows])
        return logits if bias is None else logits.add_(bias)
    logits = linear(hidden, head.weight, bias)
    if head.tp_size > 1:
        logits = get_tp_group().all_gather(logits)[..., :head.num_embeddings]
    if out is None:
        return logits if keep_dtype else logits.float()
    return out[:rows].copy_(logits)
