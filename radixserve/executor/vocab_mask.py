"""Applying a constrained request's token bitmask to its logits (before sampling).

The mask is xgrammar's layout: int32 [batch, ceil(vocab / 32)], bit j of word w allows token
32 w + j (the scheduler fills it, scheduler/grammar/vocab_mask.py). Plain PyTorch, so it runs
on any device; it is applied to the logits a decode CUDA graph returns, outside the graph, as
penalties are."""
from __future__ import annotations

import torch


def apply_vocab_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits with every token the mask disallows at -inf (a new tensor; `logits` is kept,
    the raw logprobs are computed from it)."""
    bits = torch.arange(32, dtype=torch.int32, device=mask.device)
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).view(mask.shape[0], -1)
    allowed = allowed[:, :logits.shape[-1]].to(torch.bool)
    return logits.masked_fill(~allowed, float("-inf"))
