"""The interface every prefix cache implements (RadixCache, and ChunkCache when radix is off).

Memory ownership, which every implementation keeps:
  * A KV slot is in exactly one place: the TokenToKVPool free list, the cache (tree), or a live
    request (positions [len(req.prefix_indices), kv_len) of its ReqToTokenPool row).
  * Positions [0, len(req.prefix_indices)) of a request's row are the cache's slots; the request
    keeps them alive by holding a lock on `req.cache_handle` (taken by the scheduler with
    `inc_lock_ref` right after `match_prefix`, dropped by the cache in `cache_*_req`).
  * `cache_finished_req` ends the request's hold on memory: its KV is handed to the cache (or
    freed), its ReqToTokenPool row is freed, its lock released. Retraction uses it too: the
    retracted request's KV stays cached and it re-matches when re-admitted.
  * `cache_unfinished_req` keeps the request running (next prefill chunk): its KV so far becomes
    its new prefix; the row stays allocated.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from radixserve.core.req import Req


class MatchResult(NamedTuple):
    """`indices`: KV slots (int64, CPU) of the longest cached prefix of the key.
    `handle`: opaque to callers (the RadixCache's tree node where the prefix ends); lock it
    with `inc_lock_ref` to keep `indices` from being evicted, keep it in `req.cache_handle`."""
    indices: torch.Tensor
    handle: object


def empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


class BasePrefixCache(ABC):
    # a waiting request that shares a long uncached prefix with one admitted this turn waits
    # for it to be cached (scheduler/in_batch_prefix.py), where caching makes it reusable
    defers_shared_prompts = True

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key` (updates LRU times along the path)."""

    @abstractmethod
    def cache_finished_req(self, req: "Req", token_ids: list[int] | None = None,
                           allocated_len: int | None = None) -> None:
        """Hand the request's memory back: cache (or free) its KV, free its row, drop its lock.

        `token_ids`: the tokens whose KV was written, i.e. positions [0, len(token_ids)) of the
        request's row hold valid KV. Default: `(origin_input_ids + output_ids)[:-1]` (the last
        sampled token never had its KV written). An aborted request passes
        `req.all_ids()[:kv_committed_len]`.
        `allocated_len`: how many positions of the row hold allocated slots, when more were
        allocated than written (default `len(token_ids)`); slots in
        [len(token_ids), allocated_len) are freed, not cached.
        Afterwards the request holds nothing: req_pool_idx and cache_handle are None and
        prefix_indices is empty.
        """

    @abstractmethod
    def cache_unfinished_req(self, req: "Req", token_ids: list[int] | None = None) -> None:
        """Keep the request running: its KV so far (tokens `token_ids`, default `req.fill_ids`,
        all of whose KV is written) becomes `req.prefix_indices`; `req.cache_handle` and the
        request's row are updated. The row stays allocated."""

    def restore_states(self, rows: list[int], handles: list[object]) -> None:
        """Requests just given ReqToTokenPool `rows`, admitted on the prefixes `handles` end:
        a cache that keeps per-prefix recurrent states (HybridRadixCache) copies each prefix's
        states into its row before the request's first pass. Others keep nothing."""

    def waits_behind(self, req: "Req", admitted: "list[Req]") -> bool:
        """A waiting request sharing an uncached prefix with requests `admitted` to this
        prefill batch: whether it should wait for the next batch, where the prefix is cached.
        A cache whose prefixes need more than KV (HybridRadixCache) may arrange for one of
        their passes to keep it, or say no."""
        return True

    def reserve_prompt_snapshots(self, reqs: list["Req"]) -> list[tuple[int, int, int]]:
        """Requests about to run an extend pass: (request index, tokens into its extend, state
        row) for the pass to copy the request's states into after that many tokens
        (HybridRadixCache: before a prompt's last token, and where the prompt parts from a
        cached one). Others keep nothing."""
        return []

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked cached slots if possible; return how many."""

    @abstractmethod
    def inc_lock_ref(self, handle: object | None) -> int:
        """Lock the prefix the handle ends; return the change of `evictable_size()` (<= 0)."""

    @abstractmethod
    def dec_lock_ref(self, handle: object | None) -> int:
        """Unlock the prefix the handle ends; return the change of `evictable_size()` (>= 0)."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens in unlocked nodes (what `evict` could free)."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens in locked nodes."""

    @abstractmethod
    def total_size(self) -> int:
        """All cached tokens (== evictable_size() + protected_size())."""

    @abstractmethod
    def cached_slots(self) -> torch.Tensor:
        """Every KV slot the cache owns (int64, CPU), for memory self-checks."""

    @abstractmethod
    def reset(self) -> None:
        """Forget everything. Does not touch the pools: the caller clears them too."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise AssertionError (also under `python -O`) if internal bookkeeping is broken."""

    @abstractmethod
    def format_tree(self) -> str:
        """A human-readable dump for debugging."""

    def pretty_print(self) -> None:
        print(self.format_tree())
