"""ChunkCache: the prefix cache used with --disable-radix-cache. It reuses nothing.

It exists so the scheduler drives one interface either way. Every KV slot a request holds stays
the request's own: `match_prefix` always finds nothing, `cache_unfinished_req` only records the
request's own slots as its prefix (so the next prefill chunk extends them), and
`cache_finished_req` frees all of them together with the request's row. Nothing is ever cached,
so there is nothing to evict or lock; the handle is always one sentinel object.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.mem.base_cache import BasePrefixCache, MatchResult, empty_slots
from radixserve.mem.kv_pool import KVPool
from radixserve.mem.req_to_token_pool import ReqToTokenPool

if TYPE_CHECKING:
    from radixserve.core.req import Req


_NO_PREFIX = object()  # the handle of every (empty) match


class ChunkCache(BasePrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool,
                 token_to_kv_pool: KVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.root = _NO_PREFIX

    def reset(self) -> None:
        pass

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(indices=empty_slots(), handle=self.root)

    def _read_row(self, req: "Req", length: int) -> torch.Tensor:
        if req.req_pool_idx is None:
            raise AssertionError(f"{req!r} holds no ReqToTokenPool row")
        return self.req_to_token_pool.read_row(req.req_pool_idx, length)

    def cache_finished_req(self, req: "Req", token_ids: list[int] | None = None,
                           allocated_len: int | None = None) -> None:
        kv_len = len(req.all_ids()) - 1 if token_ids is None else len(token_ids)
        allocated_len = kv_len if allocated_len is None else allocated_len
        if not len(req.prefix_indices) <= kv_len <= allocated_len:
            raise AssertionError(f"need prefix {len(req.prefix_indices)} <= kv {kv_len} "
                                 f"<= allocated {allocated_len}")
        self.token_to_kv_pool.free(self._read_row(req, allocated_len))
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.cache_handle = None
        req.prefix_indices = empty_slots()

    def cache_unfinished_req(self, req: "Req", token_ids: list[int] | None = None) -> None:
        kv_len = len(req.fill_ids if token_ids is None else token_ids)
        req.prefix_indices = self._read_row(req, kv_len)
        req.cache_handle = self.root

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, handle: object | None) -> int:
        return 0

    def dec_lock_ref(self, handle: object | None) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def cached_slots(self) -> torch.Tensor:
        return empty_slots()

    def check_invariants(self) -> None:
        if self.root is not _NO_PREFIX:
            raise AssertionError("ChunkCache's sentinel handle was replaced")

    def format_tree(self) -> str:
        return "ChunkCache (radix cache disabled: nothing cached)"
