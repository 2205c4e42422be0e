"""The token bitmask of a batch: filled on the host from each constrained request's matcher,
copied to the device once per step, applied to the logits before sampling
(executor/sampler.py `apply_vocab_mask`, outside any CUDA graph).

Layout (xgrammar's): int32 [batch, ceil(vocab / 32)], bit j of word w allows token 32 w + j;
rows of unconstrained requests are all ones (every token allowed)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.core.req import Req


def batch_vocab_mask(reqs: Sequence[Req], vocab_size: int,
                     device: torch.device | str) -> torch.Tensor | None:
    """The batch's bitmask on `device`, or None when no request is constrained."""
    rows = [(i, req.grammar) for i, req in enumerate(reqs) if req.grammar is not None]
    if not rows:
        return None
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(len(reqs), vocab_size)  # all ones
    for i, grammar in rows:
        grammar.fill_mask(mask, i)
    if torch.device(device).type == "cpu":
        return mask
    return mask.pin_memory().to(device, non_blocking=True)
