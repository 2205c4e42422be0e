"""The token embedding (vocab rows; the weight an untied LM head shares nothing with)."""
from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    """Embedding rows, one per token id. The parameter loads itself (`weight_loader`), so a
    vocab-parallel split (each rank its range of rows) is one loader away."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.weight)
