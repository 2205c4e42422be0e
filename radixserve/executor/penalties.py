"""Logit penalties of a batch: frequency/presence, repetition, and the min_new_tokens stop mask.

All penalties act on the raw logits, before temperature, in this order (vLLM V1's sampler:
its min-tokens and logit-bias processors, then its penalties):
  1. min_new_tokens: while a request has fewer than min_new_tokens output tokens, every token
     that would stop it (EOS unless ignore_eos, and its stop_token_ids) gets -inf.
  2. logit_bias (OpenAI semantics): each listed token's bias is added to its logit.
  3. repetition (HF/vLLM semantics), over every token seen so far (prompt + output):
       logit > 0 -> logit / penalty, else logit * penalty
  4. frequency / presence (OpenAI semantics), over the *output* tokens only:
       logit -= frequency * count + presence * (count > 0)
(Only repetition depends on the order: it scales a biased logit, by its biased sign.)

Invariants: every tensor has one row per request of the batch; a request that does not use a
penalty holds its neutral value (repetition 1, frequency/presence 0, min_new_tokens 0), so rows
need no per-row branching. A group of tensors is None when no request of the batch uses it, and
`BatchPenalties.build` returns None when no request uses any penalty.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from radixserve.core.req import Req


def _token_mask_indices(token_lists: Sequence[Sequence[int]], rows: Sequence[int],
                        vocab_size: int) -> torch.Tensor:
    """Flat indices `row * vocab_size + token` (CPU int64) for the tokens of the given rows.
    numpy's fromiter converts Python ints several times faster than torch.tensor(list)."""
    lens = np.fromiter((len(tokens) for tokens in token_lists), dtype=np.int64,
                       count=len(token_lists))
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64,
                         count=int(lens.sum()))
    row_ids = np.repeat(np.asarray(rows, dtype=np.int64), lens)
    return torch.from_numpy(row_ids * vocab_size + tokens)


def _stop_token_ids(req: "Req", eos_token_ids: Iterable[int], vocab_size: int) -> list[int]:
    params = req.sampling_params
    stops = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stops.update(eos_token_ids)
    return sorted(t for t in stops if 0 <= t < vocab_size)


# every tensor of BatchPenalties: (name, neutral value, one column per vocabulary entry)
_PENALTY_FIELDS: tuple[tuple[str, float, bool], ...] = (
    ("frequency_penalties", 0.0, False), ("presence_penalties", 0.0, False),
    ("output_token_counts", 0.0, True), ("repetition_penalties", 1.0, False),
    ("seen_token_mask", False, True), ("min_new_tokens", 0, False), ("output_lens", 0, False),
    ("stop_token_mask", False, True), ("logit_bias", 0.0, True))


@dataclass
class BatchPenalties:
    """Penalty state of one batch, as device tensors ([bs, 1] coefficients, [bs, vocab] tables)."""
    vocab_size: int
    # frequency / presence
    frequency_penalties: torch.Tensor | None = None  # [bs, 1] float32
    presence_penalties: torch.Tensor | None = None  # [bs, 1] float32
    output_token_counts: torch.Tensor | None = None  # [bs, vocab] float32
    # repetition
    repetition_penalties: torch.Tensor | None = None  # [bs, 1] float32
    seen_token_mask: torch.Tensor | None = None  # [bs, vocab] bool, prompt + output tokens
    # min_new_tokens
    min_new_tokens: torch.Tensor | None = None  # [bs] int64
    output_lens: torch.Tensor | None = None  # [bs] int64
    stop_token_mask: torch.Tensor | None = None  # [bs, vocab] bool
    # logit_bias
    logit_bias: torch.Tensor | None = None  # [bs, vocab] float32, 0 where no bias

    @classmethod
    def build(cls, reqs: Sequence["Req"], vocab_size: int, device: torch.device | str,
              eos_token_ids: Iterable[int] = ()) -> "BatchPenalties | None":
        """Penalty tensors for `reqs`, or None when no request uses any penalty (the usual case)."""
        freq_rows: list[int] = []
        rep_rows: list[int] = []
        min_new_rows: list[int] = []
        bias_rows: list[int] = []
        for i, req in enumerate(reqs):
            params = req.sampling_params
            if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
                freq_rows.append(i)
            if params.repetition_penalty != 1.0:
                rep_rows.append(i)
            if len(req.output_ids) < params.min_new_tokens:
                min_new_rows.append(i)
            if params.logit_bias:
                bias_rows.append(i)
        if not (freq_rows or rep_rows or min_new_rows or bias_rows):
            return None

        bs = len(reqs)
        out = cls(vocab_size=vocab_size)
        if freq_rows:
            coeffs = torch.tensor([[r.sampling_params.frequency_penalty,
                                    r.sampling_params.presence_penalty] for r in reqs],
                                  dtype=torch.float32).to(device, non_blocking=True)
            out.frequency_penalties, out.presence_penalties = coeffs[:, 0:1], coeffs[:, 1:2]
            flat = _token_mask_indices([reqs[i].output_ids for i in freq_rows], freq_rows,
                                       vocab_size).to(device, non_blocking=True)
            counts = torch.zeros(bs * vocab_size, dtype=torch.float32, device=device)
            counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32,
                                                  device=device))
            out.output_token_counts = counts.view(bs, vocab_size)
        if rep_rows:
            out.repetition_penalties = torch.tensor(
                [[r.sampling_params.repetition_penalty] for r in reqs],
                dtype=torch.float32).to(device, non_blocking=True)
            segments = [ids for i in rep_rows for ids in (reqs[i].origin_input_ids,
                                                          reqs[i].output_ids)]
            segment_rows = [i for i in rep_rows for _ in range(2)]
            flat = _token_mask_indices(segments, segment_rows,
                                       vocab_size).to(device, non_blocking=True)
            seen = torch.zeros(bs * vocab_size, dtype=torch.bool, device=device)
            seen[flat] = True
            out.seen_token_mask = seen.view(bs, vocab_size)
        if min_new_rows:
            lens = torch.tensor([[r.sampling_params.min_new_tokens, len(r.output_ids)]
                                 for r in reqs], dtype=torch.int64).to(device, non_blocking=True)
            out.min_new_tokens, out.output_lens = lens[:, 0], lens[:, 1].clone()
            flat = _token_mask_indices(
                [_stop_token_ids(reqs[i], eos_token_ids, vocab_size) for i in min_new_rows],
                min_new_rows, vocab_size).to(device, non_blocking=True)
            stop_mask = torch.zeros(bs * vocab_size, dtype=torch.bool, device=device)
            stop_mask[flat] = True
            out.stop_token_mask = stop_mask.view(bs, vocab_size)
        if bias_rows:
            bias = torch.zeros((bs, vocab_size), dtype=torch.float32)
            for i in bias_rows:
                table = reqs[i].sampling_params.logit_bias or {}
                bias[i, list(table)] = torch.tensor(list(table.values()), dtype=torch.float32)
            out.logit_bias = bias.to(device, non_blocking=True)
        return out

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return penalised float32 logits [bs, vocab]; `logits` itself is left unchanged."""
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns, penalties were built "
                             f"for vocab_size {self.vocab_size}")
        logits = logits.float()
        if self.stop_token_mask is not None:
            still_short = (self.output_lens < self.min_new_tokens).unsqueeze(1)
            logits = logits.masked_fill(self.stop_token_mask & still_short, float("-inf"))
        if self.logit_bias is not None:
            logits = logits + self.logit_bias
        if self.seen_token_mask is not None:
            penalties = self.repetition_penalties
            penalised = torch.where(logits > 0, logits / penalties, logits * penalties)
            logits = torch.where(self.seen_token_mask, penalised, logits)
        if self.output_token_counts is not None:
            counts = self.output_token_counts
            logits = logits - self.frequency_penalties * counts \
                - self.presence_penalties * (counts > 0).float()
        return logits

    def filter(self, rows: torch.Tensor) -> "BatchPenalties":
        """The state of rows `rows` (device int64 indices, in the new batch's order)."""
        out = BatchPenalties(vocab_size=self.vocab_size)
        for name, _, _ in _PENALTY_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(out, name, value.index_select(0, rows))
        return out

    @staticmethod
    def concat(first: "BatchPenalties | None", second: "BatchPenalties | None",
               first_rows: int, second_rows: int) -> "BatchPenalties | None":
        """The state of a batch made of `first`'s rows, then `second`'s (either may be None:
        a batch whose rows use no penalty). A group used by only one side gets its neutral
        value on the other side's rows."""
        if first is None and second is None:
            return None
        some = first if first is not None else second
        assert some is not None
        out = BatchPenalties(vocab_size=some.vocab_size)
        for name, neutral, per_token in _PENALTY_FIELDS:
            a = None if first is None else getattr(first, name)
            b = None if second is None else getattr(second, name)
            if a is None and b is None:
                continue
            like = a if a is not None else b
            assert like is not None

            def part(value: torch.Tensor | None, rows: int) -> torch.Tensor:
                if value is not None:
                    return value
                shape = (rows, some.vocab_size) if per_token else (rows, *like.shape[1:])
                return torch.full(shape, neutral, dtype=like.dtype, device=like.device)

            setattr(out, name, torch.cat((part(a, first_rows), part(b, second_rows))))
        return out

    def advance(self, next_token_ids: torch.Tensor) -> None:
        """Account for one sampled token per row (on device, no host sync), so the same batch
        can run another decode step without rebuilding. Only valid while the batch keeps the
        same requests in the same order."""
        ids = next_token_ids.view(-1, 1).to(torch.int64)
        if self.output_token_counts is not None:
            self.output_token_counts.scatter_add_(
                1, ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
        if self.seen_token_mask is not None:
            self.seen_token_mask.scatter_(1, ids, True)
        if self.output_lens is not None:
            self.output_lens += 1
