"""Admission of waiting requests into a prefill batch (v0.2's estimate plus chunked prefill).

Three budgets, all in tokens:
  total  free + evictable KV, minus the tokens the running requests are still expected to
         generate: sum(remaining max_new_tokens) * new_token_ratio. A new request needs its
         extend tokens plus its (clipped) max_new_tokens.
  input  --max-prefill-tokens of new tokens per prefill batch.
  chunk  --chunked-prefill-size: a request longer than what is left of it is cut, and the rest is
         prefilled in later turns (at most one such request in flight).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.core.req import Req

if TYPE_CHECKING:
    from radixserve.mem.base_cache import BasePrefixCache

# a huge max_new_tokens (e.g. "up to the context length") must not block admission forever
CLIP_MAX_NEW_TOKENS = 4096


def expected_new_tokens(req: Req) -> int:
    return min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS)


@dataclass
class PrefillAdder:
    tree_cache: "BasePrefixCache"
    rem_total_tokens: float
    rem_input_tokens: int
    rem_chunk_tokens: int | None  # None: chunking disabled
    max_new_reqs: int
    can_run: list[Req] = field(default_factory=list)
    new_chunked_req: Req | None = None
    new_input_tokens: int = 0
    new_cached_tokens: int = 0

    @classmethod
    def create(cls, tree_cache: "BasePrefixCache", available_tokens: int, running: list[Req],
               chunked_req: Req | None, new_token_ratio: float, max_prefill_tokens: int,
               chunked_prefill_size: int | None, max_new_reqs: int) -> "PrefillAdder":
        reserved = sum(expected_new_tokens(r) for r in running) * new_token_ratio
        if chunked_req is not None:
            # the request being chunked still needs its remaining prompt and its output
            reserved += chunked_req.extend_input_len + expected_new_tokens(chunked_req)
        return cls(tree_cache,
                   rem_total_tokens=available_tokens + tree_cache.evictable_size() - reserved,
                   rem_input_tokens=max_prefill_tokens,
                   rem_chunk_tokens=chunked_prefill_size,
                   max_new_reqs=max_new_reqs)

    def _budget_left(self) -> bool:
        if self.rem_total_tokens <= 0 or self.rem_input_tokens <= 0:
            return False
        return self.rem_chunk_tokens is None or self.rem_chunk_tokens > 0

    def add_chunked_req(self, req: Req) -> None:
        """Continue the request being chunked: its next chunk, as much as the budgets allow.
        Its memory was budgeted when it was first admitted (it holds its lock and row)."""
        take = req.extend_input_len
        if self.rem_chunk_tokens is not None:
            take = min(take, self.rem_chunk_tokens)
        take = min(take, self.rem_input_tokens)
        self._admit(req, take, newly_locked=False)

    def add_one_req(self, req: Req) -> bool:
        """Try to admit `req` (prefix already matched). False: stop looking further."""
        if len(self.can_run) >= self.max_new_reqs or self.new_chunked_req is not None \
                or not self._budget_left():
            return False
        need = req.extend_input_len + expected_new_tokens(req)
        if need > self.rem_total_tokens:
            return False
        # locking the prefix takes it out of the evictable pool: re-check afterwards
        self.rem_total_tokens += self.tree_cache.inc_lock_ref(req.cache_handle)
        if need > self.rem_total_tokens:
            self.rem_total_tokens += self.tree_cache.dec_lock_ref(req.cache_handle)
            return False
        take = req.extend_input_len
        if self.rem_chunk_tokens is not None:
            take = min(take, self.rem_chunk_tokens, self.rem_input_tokens)
        elif take > self.rem_input_tokens and self.can_run:
            take = 0  # too long for what is left of this batch: next turn
        if take <= 0:
            self.rem_total_tokens += self.tree_cache.dec_lock_ref(req.cache_handle)
            return False
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
        self.new_cached_tokens += len(req.prefix_indices)
        self.rem_input_tokens -= take
        if newly_locked:
            self.rem_total_tokens -= take
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= take
