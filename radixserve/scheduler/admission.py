"""Admission of waiting requests into a prefill batch (v0.2's estimate, an exact check for
requests of known length, and chunked prefill).

Budgets, all in tokens:
  total  free + evictable KV, minus what running requests are still expected to generate.
         A request that may stop early (EOS, stop strings, a grammar) is expected to generate
         sum(remaining max_new_tokens) * new_token_ratio, reserved for its whole life (v0.2).
         A request of known length (ignore_eos, nothing else that stops it) will generate
         exactly its remaining max_new_tokens, so a flat reservation would either over-admit
         (with the ratio, then retract) or under-fill (without it). These requests pass the
         peak check instead: sorted by tokens left, at the moment the j-th of them finishes
         every request still running has grown by that many tokens, while every one that
         finished before it has handed back its KV (prompt + output, to the free list or the
         radix cache's evictable part). Admission keeps every such moment above zero free tokens.
  input  --max-prefill-tokens of new tokens per prefill batch.
  chunk  --chunked-prefill-size: a request longer than what is left of it is cut, and the rest is
         prefilled in later turns (at most one such request in flight).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from radixserve.core.req import Req

if TYPE_CHECKING:
    from radixserve.mem.base_cache import BasePrefixCache

# a huge max_new_tokens (e.g. "up to the context length") must not block admission forever
CLIP_MAX_NEW_TOKENS = 4096
# free tokens the peak check keeps per request still running at each moment (one decode step)
PEAK_RESERVE_PER_REQUEST = 1


def expected_new_tokens(req: Req) -> int:
    return min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS)


def has_known_length(req: Req) -> bool:
    """True when the request will run to max_new_tokens: nothing but the length can stop it."""
    params = req.sampling_params
    return (params.ignore_eos and not params.stop_strs and not params.stop_token_ids
            and req.grammar is None)


@dataclass
class PeakCheck:
    """Requests of known length as (tokens left to generate, tokens held when finished minus
    tokens left), sorted by tokens left.

    `fits` answers at once when the free tokens cover every request's remaining growth (the
    common case: a pool with room), else in O(log n) from tables rebuilt (vectorised, O(n))
    after each `add`: with n
    requests sorted by tokens left l_j, F_j the tokens handed back before the j-th finishes,
    and R the reserve, moment j of the list as it stands needs free + E_j >= 0 with
    E_j = F_j - (l_j + R)(n - j). A new request (l, h) inserted at position a adds one request
    running at every moment before it (E_j - (l_j + R)), its own moment
    (F_a - (l + R)(n + 1 - a)), and its h tokens handed back at every moment after it
    (E_j + h): so a prefix minimum and a suffix minimum decide every moment at once."""
    left: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    # derived from left/held by _build (None until the next fits after an add)
    _tables: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(
        default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # sum of (l_j + R): what every request still running will yet need, an upper bound
        # of every moment's need (moment j needs (l_j + R)(n - j) <= the sum over i >= j)
        self._need = sum(self.left) + PEAK_RESERVE_PER_REQUEST * len(self.left)

    def add(self, tokens_left: int, tokens_held: int) -> None:
        at = bisect.bisect_right(self.left, tokens_left)
        self.left.insert(at, tokens_left)
        self.held.insert(at, tokens_held)
        self._need += tokens_left + PEAK_RESERVE_PER_REQUEST
        self._tables = None

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(self.left)
        left = np.asarray(self.left, dtype=np.float64) + PEAK_RESERVE_PER_REQUEST
        freed = np.zeros(n + 1)
        np.cumsum(np.asarray(self.held, dtype=np.float64), out=freed[1:])
        moments = freed[:n] - left * (n - np.arange(n))  # E_j
        before = np.full(n + 1, np.inf)  # min over j < a of E_j - (l_j + R)
        np.minimum.accumulate(moments - left, out=before[1:])
        after = np.full(n + 1, np.inf)  # min over j >= a of E_j
        after[:n] = np.minimum.accumulate(moments[::-1])[::-1]
        return freed, before, after

    def holds(self, free: float) -> bool:
        """Does every finishing moment of the requests as they stand keep the reserve?
        free: tokens free now."""
        if not self.left or free >= self._need:
            return True
        if self._tables is None:
            self._tables = self._build()
        return bool(free + self._tables[2][0] >= 0)  # the least moment, E_j's minimum

    def fits(self, free: float, tokens_left: int, tokens_held: int) -> bool:
        """Would adding this request keep every finishing moment at or above the reserve?
        free: tokens free now, after the request's prompt is stored."""
        if free >= self._need + tokens_left + PEAK_RESERVE_PER_REQUEST:
            return True  # room for everything still to come: no moment can fall short
        if self._tables is None:
            self._tables = self._build()
        freed, before, after = self._tables
        at = bisect.bisect_right(self.left, tokens_left)
        own = freed[at] - (tokens_left + PEAK_RESERVE_PER_REQUEST) * (len(self.left) + 1 - at)
        return bool(free + before[at] >= 0 and free + own >= 0
                    and free + tokens_held + after[at] >= 0)


@dataclass
class PrefillAdder:
    tree_cache: "BasePrefixCache"
    rem_total_tokens: float
    rem_input_tokens: int
    rem_chunk_tokens: int | None  # None: chunking disabled
    max_new_reqs: int
    peak: PeakCheck = field(default_factory=PeakCheck)
    can_run: list[Req] = field(default_factory=list)
    new_chunked_req: Req | None = None
    new_input_tokens: int = 0
    new_cached_tokens: int = 0
    continues_chunked_req: bool = False  # can_run[0] is the request being chunked

    @property
    def admitted_from_queue(self) -> int:
        """How many of can_run came from the waiting queue this turn (all but a continued
        chunked request)."""
        return len(self.can_run) - self.continues_chunked_req

    @classmethod
    def create(cls, tree_cache: "BasePrefixCache", available_tokens: int, running: list[Req],
               chunked_req: Req | None, new_token_ratio: float, max_prefill_tokens: int,
               chunked_prefill_size: int | None, max_new_reqs: int) -> "PrefillAdder":
        peak = PeakCheck()
        reserved = 0.0
        for r in running:
            if has_known_length(r):
                peak.add(expected_new_tokens(r), r.seqlen)
            else:
                reserved += expected_new_tokens(r) * new_token_ratio
        if chunked_req is not None:
            # the request being chunked still needs its remaining prompt and its output
            reserved += chunked_req.extend_input_len
            if has_known_length(chunked_req):
                peak.add(expected_new_tokens(chunked_req), len(chunked_req.origin_input_ids))
            else:
                reserved += expected_new_tokens(chunked_req)
        return cls(tree_cache,
                   rem_total_tokens=available_tokens + tree_cache.evictable_size() - reserved,
                   rem_input_tokens=max_prefill_tokens,
                   rem_chunk_tokens=chunked_prefill_size,
                   max_new_reqs=max_new_reqs, peak=peak)

    def _budget_left(self) -> bool:
        if self.rem_total_tokens <= 0 or self.rem_input_tokens <= 0:
            return False
        return self.rem_chunk_tokens is None or self.rem_chunk_tokens > 0

    def _fits(self, req: Req) -> bool:
        """Room for the prompt's new tokens and what the request will generate."""
        new_tokens = expected_new_tokens(req)
        if not has_known_length(req):
            return req.extend_input_len + new_tokens <= self.rem_total_tokens
        return self.peak.fits(self.rem_total_tokens - req.extend_input_len, new_tokens,
                              req.seqlen)

    def add_chunked_req(self, req: Req) -> None:
        """Continue the request being chunked: its next chunk, as much as the budgets allow.
        Its memory was budgeted when it was first admitted (it holds its lock and row)."""
        take = req.extend_input_len
        if self.rem_chunk_tokens is not None:
            take = min(take, self.rem_chunk_tokens)
        take = whole_span_take(req, min(take, self.rem_input_tokens))
        self._admit(req, take, newly_locked=False)
        self.continues_chunked_req = True

    def add_one_req(self, req: Req) -> bool:
        """Try to admit `req` (prefix already matched). False: stop looking further."""
        if len(self.can_run) >= self.max_new_reqs or self.new_chunked_req is not None \
                or not self._budget_left():
            return False
        if not self._fits(req):
            return False
        # locking the prefix takes it out of the evictable pool: re-check afterwards
        self.rem_total_tokens += self.tree_cache.inc_lock_ref(req.cache_handle)
        if not self._fits(req):
            self.rem_total_tokens += self.tree_cache.dec_lock_ref(req.cache_handle)
            return False
        take = req.extend_input_len
        if self.rem_chunk_tokens is not None:
            take = min(take, self.rem_chunk_tokens, self.rem_input_tokens)
            if take > 0:
                take = whole_span_take(req, take)
        elif take > self.rem_input_tokens and self.can_run:
            take = 0  # too long for what is left of this batch: next turn
        if take <= 0:
            self.rem_total_tokens += self.tree_cache.dec_lock_ref(req.cache_handle)
            return False
        if has_known_length(req):
            self.peak.add(expected_new_tokens(req), req.seqlen)
            if take < req.extend_input_len:  # the rest of the prompt comes in later chunks
                self.rem_total_tokens -= req.extend_input_len - take
        else:
            self.rem_total_tokens -= expected_new_tokens(req)
        self._admit(req, take, newly_locked=True)
        return True

    def _admit(self, req: Req, take: int, newly_locked: bool) -> None:
        if take < req.extend_input_len:
            # cut the prompt: this chunk covers fill_ids[:prefix + take]
            req.fill_ids = req.fill_ids[:len(req.prefix_indices) + take]
            req.extend_input_len = take
            req.is_being_chunked = True
            self.new_chunked_req = req
        else:
            req.is_being_chunked = False
        self.can_run.append(req)
        self.new_input_tokens += take
        if newly_locked:  # a chunk's own earlier chunks are no cache hit
            self.new_cached_tokens += len(req.prefix_indices)
        self.rem_input_tokens -= take
        if newly_locked:
            self.rem_total_tokens -= take
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= take


def whole_span_take(req: Req, take: int) -> int:
    """A chunk of `take` prompt tokens moved so it ends outside the request's whole spans
    (Req.whole_spans: an image whose tokens see each other both ways needs them in one pass):
    back to the span's start, or on to its end where the chunk starts inside it or at it."""
    start = len(req.prefix_indices)
    end = start + take
    for first, last in req.whole_spans:
        if first < end < last:
            return first - start if first > start else last - start
    return take
