"""Sampler: batched next-token sampling, and the logprob helpers the ModelRunner returns.

Sampling order, per row: penalties and the min_new_tokens mask (on raw logits), then a
grammar's token mask (constrained decoding; where it allows only the stop tokens that
min_new_tokens masks, the grammar wins) -> greedy rows take
the argmax -> temperature -> softmax -> top-k, then top-p on the renormalised top-k mass, then
min-p (relative to the most likely token) -> sample.

The three filters each keep a prefix of the probabilities sorted in descending order, so the
sorted values are computed once and the kept prefix is turned into a probability threshold that is
applied in vocabulary order; tokens tied with the last kept probability are kept as well. Working
in vocabulary order means a seeded row's noise is indexed by token id, so its draw does not depend
on how the sort orders ties.

Sampling uses the exponential race: argmax_i(p_i / E_i) with E_i ~ Exp(1) i.i.d. picks token i with
probability p_i / sum(p), so the probabilities need no renormalisation and there is no host sync.
Unseeded rows draw E from the global RNG; seeded rows from their own per-step generator.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from radixserve.executor.sampling_info import SamplingBatchInfo
from radixserve.executor.vocab_mask import apply_vocab_mask

TopLogprobs = list[list[tuple[float, int]]]


class Sampler:
    """Stateless; one instance per ModelRunner."""

    def forward(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """logits [bs, vocab] (any float dtype; not modified) -> next token ids [bs] int64."""
        if logits.shape[0] != info.batch_size:
            raise ValueError(f"logits have {logits.shape[0]} rows, batch has {info.batch_size}")
        raw = logits.float()
        logits = raw if info.penalties is None else info.penalties.apply(raw)
        if info.vocab_mask is not None:
            logits = apply_vocab_mask(logits, info.vocab_mask)
            if info.penalties is not None and info.penalties.stop_token_mask is not None:
                logits = _grammar_end_wins(logits, raw, info.vocab_mask)
        if info.is_all_greedy:
            return logits.argmax(dim=-1)

        probs = torch.softmax(logits / info.temperatures, dim=-1)
        if info.need_top_k or info.need_top_p or info.need_min_p:
            probs = filter_top_k_top_p_min_p(probs, info)
        sampled = sample_exponential_race(probs, info.seeded_generators())
        if info.has_greedy:
            sampled = torch.where(info.greedy_mask, logits.argmax(dim=-1), sampled)
        return sampled

    __call__ = forward


def _grammar_end_wins(logits: torch.Tensor, raw: torch.Tensor,
                      vocab_mask: torch.Tensor) -> torch.Tensor:
    """A row whose grammar allows only stop tokens while min_new_tokens masks them has no token
    left: the grammar's end wins (its stop tokens from the unpenalised logits), so the output
    still matches the grammar and the request ends there. No host sync."""
    dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
    return torch.where(dead, apply_vocab_mask(raw, vocab_mask), logits)


def filter_top_k_top_p_min_p(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p or min-p drop (probs [bs, vocab], rows sum to 1).

    Only as much of the descending order as the filters need is computed: none for min-p alone
    (it needs only the maximum), the first max_top_k entries when every sampled row has a top-k
    (top-p is taken over the renormalised top-k mass, so nothing beyond it matters), else a full
    sort."""
    if info.need_min_p and not (info.need_top_k or info.need_top_p):
        threshold = probs.amax(dim=-1, keepdim=True) * info.min_ps.unsqueeze(1)
        return probs.masked_fill(probs < threshold, 0.0)
    if info.max_top_k < probs.shape[-1]:
        sorted_probs = probs.topk(info.max_top_k, dim=-1, sorted=True).values
    else:
        sorted_probs = probs.sort(dim=-1, descending=True).values
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if info.need_top_k:
        ranks = torch.arange(sorted_probs.shape[-1], device=probs.device)
        keep &= ranks.unsqueeze(0) < info.top_ks.unsqueeze(1)
    if info.need_top_p:
        kept_probs = sorted_probs * keep if info.need_top_k else sorted_probs
        cumulative = kept_probs.cumsum(dim=-1)
        kept_mass = cumulative[:, -1:]
        # keep a token while the mass strictly before it is below top_p of the kept mass
        keep &= (cumulative - kept_probs) < info.top_ps.unsqueeze(1) * kept_mass
    if info.need_min_p:
        keep &= sorted_probs >= sorted_probs[:, :1] * info.min_ps.unsqueeze(1)
    # every mask is a prefix of the sorted order and keeps at least the first token
    num_kept = keep.sum(dim=-1, keepdim=True).clamp_min(1)
    threshold = sorted_probs.gather(1, num_kept - 1)
    return probs.masked_fill(probs < threshold, 0.0)


def sample_exponential_race(probs: torch.Tensor,
                            seeded: Sequence[tuple[int, torch.Generator]] = ()) -> torch.Tensor:
    """One token per row, token i drawn with probability probs[i] / sum(probs) (unnormalised is
    fine). Rows listed in `seeded` draw their noise from the given generator."""
    noise = torch.empty_like(probs).exponential_()
    for row, generator in seeded:
        noise[row].exponential_(generator=generator)
    # Exp(1) can return 0; 0/0 would be NaN, which argmax would pick
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


# ---- logprobs ----

class LogprobResult(NamedTuple):
    token_logprobs: torch.Tensor  # [rows] float32, logprob of the given token of each row
    top_logprobs: TopLogprobs  # per row, its top-k as (logprob, token_id), best first


class DeviceLogprobs(NamedTuple):
    """compute_logprobs' results still on the device: nothing read back yet."""
    token_logprobs: torch.Tensor  # [rows] float32
    top_values: torch.Tensor | None  # [rows, max_k] float32, None when no row wants a top-k
    top_ids: torch.Tensor | None  # [rows, max_k] int64


def compute_logprobs_on_device(logits: torch.Tensor, token_ids: torch.Tensor, max_k: int,
                               chunk_rows: int = 512) -> DeviceLogprobs:
    """The device half of compute_logprobs: no host sync (the overlap path copies the results
    back asynchronously with the sampled ids)."""
    if token_ids.shape[0] != logits.shape[0]:
        raise ValueError("logits and token_ids must have the same number of rows")
    max_k = min(max_k, logits.shape[-1])
    chosen_parts: list[torch.Tensor] = []
    top_values: list[torch.Tensor] = []
    top_ids: list[torch.Tensor] = []
    ids = token_ids.view(-1, 1).to(torch.int64)
    for start in range(0, logits.shape[0], chunk_rows):
        chunk = logits[start:start + chunk_rows].float()
        normaliser = torch.logsumexp(chunk, dim=-1, keepdim=True)
        chosen_parts.append((chunk.gather(1, ids[start:start + chunk_rows]) - normaliser)
                            .squeeze(1))
        if max_k > 0:
            values, indices = chunk.topk(max_k, dim=-1)
            top_values.append(values - normaliser)
            top_ids.append(indices)
    if chosen_parts:
        chosen = torch.cat(chosen_parts)
    else:
        chosen = torch.empty(0, dtype=torch.float32, device=logits.device)
    if max_k == 0:
        return DeviceLogprobs(chosen, None, None)
    return DeviceLogprobs(chosen, torch.cat(top_values), torch.cat(top_ids))


def top_logprob_lists(values: list[list[float]] | None, ids: list[list[int]] | None,
                      top_k_nums: Sequence[int]) -> TopLogprobs:
    """Per row, its first top_k_nums[row] (logprob, token_id) pairs (host lists)."""
    if values is None or ids is None:
        return [[] for _ in top_k_nums]
    return [list(zip(values[row][:k], ids[row][:k])) for row, k in enumerate(top_k_nums)]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_k_nums: Sequence[int],
                     chunk_rows: int = 512) -> LogprobResult:
    """Logprobs of `token_ids` under log_softmax of the *raw* logits [rows, vocab].

    Raw means before penalties and temperature: the model's own distribution, which is what vLLM
    returns by default and what SGLang v0.2 returned, and it does not change with the request's
    sampling knobs. top_k_nums[i] top entries are returned for row i (0: none). Rows are
    processed `chunk_rows` at a time so long prompts never hold a float32 [T, vocab] copy. The
    top lists need one device-to-host copy; token_logprobs stays on the device.
    """
    if len(top_k_nums) != logits.shape[0]:
        raise ValueError("logits, token_ids and top_k_nums must have the same number of rows")
    result = compute_logprobs_on_device(logits, token_ids, max(top_k_nums, default=0),
                                        chunk_rows)
    if result.top_values is None or result.top_ids is None:
        return LogprobResult(result.token_logprobs, top_logprob_lists(None, None, top_k_nums))
    return LogprobResult(result.token_logprobs,
                         top_logprob_lists(result.top_values.tolist(), result.top_ids.tolist(),
                                           top_k_nums))


def extend_next_token_ids(input_ids: torch.Tensor, extend_seq_lens: Sequence[int],
                          last_next_ids: torch.Tensor | None = None) -> torch.Tensor:
    """For the packed tokens of an extend pass [T], the token each position predicts: the next
    input token of the same request. A request's last position predicts the token after its
    extend tokens: `last_next_ids[i]` (the sampled token, or the next chunk's first token), or
    0 when not given (then that position's logprob is meaningless)."""
    next_ids = torch.roll(input_ids.to(torch.int64), shifts=-1)
    if len(extend_seq_lens) == 0:
        return next_ids
    lens = torch.tensor(list(extend_seq_lens), dtype=torch.int64, device=input_ids.device)
    last_positions = lens.cumsum(0) - 1
    if last_next_ids is None:
        next_ids[last_positions] = 0
    else:
        next_ids[last_positions] = last_next_ids.to(torch.int64)
    return next_ids


def compute_input_logprobs(extend_logits: torch.Tensor, next_token_ids: torch.Tensor,
                           top_k_nums: Sequence[int] | int = 0,
                           chunk_rows: int = 512) -> LogprobResult:
    """Prompt-token logprobs of an extend pass: extend_logits [T, vocab] at each position, and
    next_token_ids [T] (see extend_next_token_ids). Position j's result is the logprob of the
    token at j+1 given everything up to j. top_k_nums is one int for every position or one per
    position. Pass only the positions you need (from logprob_start_len on): memory and the
    host copy of the top lists scale with T."""
    if isinstance(top_k_nums, int):
        top_k_nums = [top_k_nums] * extend_logits.shape[0]
    return compute_logprobs(extend_logits, next_token_ids, top_k_nums, chunk_rows=chunk_rows)
