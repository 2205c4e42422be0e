"""Test scaffolding: the memory side of a scheduler, driving a prefix cache with real pools.

It does what the real scheduler does with memory: admit a request (row, prefix match, lock, KV
slots for the next prefill chunk), finish a chunk (cache_unfinished_req), decode (one KV slot per
step), finish / retract / abort (cache_finished_req). It tracks `kv_len` per request: positions
[0, kv_len) of the request's row hold allocated slots.
"""
from __future__ import annotations

import torch

from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.mem.base_cache import BasePrefixCache
from radixserve.mem.kv_pool import KVCacheSpec, KVPool, make_kv_pool
from radixserve.mem.req_to_token_pool import ReqToTokenPool


def make_pools(kv_size: int = 64, req_slots: int = 8,
               max_context_len: int = 64) -> tuple[ReqToTokenPool, KVPool]:
    req_pool = ReqToTokenPool(req_slots, max_context_len, "cpu")
    kv_pool = make_kv_pool(kv_size, KVCacheSpec("mha", num_layers=1, num_kv_heads=1,
                                                 head_dim=1, dtype=torch.float32), "cpu")
    return req_pool, kv_pool


def make_req(rid: str, prompt: list[int]) -> Req:
    return Req(rid, prompt, SamplingParams(max_new_tokens=1000))


class MiniScheduler:
    def __init__(self, cache: BasePrefixCache, req_pool: ReqToTokenPool,
                 kv_pool: KVPool) -> None:
        self.cache = cache
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.kv_lens: dict[str, int] = {}  # live requests only
        self.decoding: set[str] = set()  # live requests whose prefill is done

    def row(self, req: Req) -> torch.Tensor:
        """The request's table row (a copy); the device table and its host copy must agree."""
        assert req.req_pool_idx is not None
        device_row = self.req_pool.req_to_token[req.req_pool_idx]
        host_row = torch.from_numpy(self.req_pool.host_table[req.req_pool_idx].copy())
        assert torch.equal(device_row, host_row), "req_to_token and its host copy differ"
        return host_row

    def alloc_kv(self, num: int) -> torch.Tensor | None:
        slots = self.kv_pool.alloc(num)
        if slots is None:
            self.cache.evict(num - self.kv_pool.available_size())
            slots = self.kv_pool.alloc(num)
        return slots

    def is_prefilling(self, req: Req) -> bool:
        return req.rid not in self.decoding

    def admit(self, req: Req, chunk_len: int) -> bool:
        """Admit `req` and allocate its first prefill chunk (at most `chunk_len` new tokens).
        Returns False (and holds nothing) if memory is short."""
        rows = self.req_pool.alloc(1)
        if rows is None:
            return False
        req.req_pool_idx = rows[0]
        req.init_next_round_input()
        # like SGLang: leave at least one token to compute, so there are logits to sample from
        prefix, handle = self.cache.match_prefix(req.fill_ids[:-1])
        req.prefix_indices, req.cache_handle = prefix, handle
        self.cache.inc_lock_ref(handle)
        self.req_pool.write(req.req_pool_idx, 0, prefix)
        self.kv_lens[req.rid] = len(prefix)
        if not self._alloc_chunk(req, chunk_len):
            self.cache.dec_lock_ref(handle)
            self.req_pool.free(req.req_pool_idx)
            req.req_pool_idx, req.cache_handle = None, None
            req.prefix_indices = torch.empty(0, dtype=torch.int64)
            del self.kv_lens[req.rid]
            return False
        return True

    def _alloc_chunk(self, req: Req, chunk_len: int) -> bool:
        start = self.kv_lens[req.rid]
        end = min(len(req.all_ids()), start + chunk_len)
        slots = self.alloc_kv(end - start)
        if slots is None:
            return False
        self.req_pool.write(req.req_pool_idx, start, slots)
        req.fill_ids = req.all_ids()[:end]
        self.kv_lens[req.rid] = end
        return True

    def run_prefill(self, req: Req, sampled: int) -> None:
        """The forward pass of the current chunk ran: a final chunk samples the next token, a
        non-final one is cached so the next chunk extends it."""
        if self.kv_lens[req.rid] == len(req.all_ids()):
            req.output_ids.append(sampled)
            self.decoding.add(req.rid)
        else:
            self.cache.cache_unfinished_req(req)

    def next_chunk(self, req: Req, chunk_len: int) -> bool:
        assert self.is_prefilling(req)
        return self._alloc_chunk(req, chunk_len)

    def decode(self, req: Req, sampled: int) -> bool:
        """One decode step: a KV slot for the last token, then append the sampled token."""
        assert not self.is_prefilling(req)
        slots = self.alloc_kv(1)
        if slots is None:
            return False
        kv_len = self.kv_lens[req.rid]
        self.req_pool.write(req.req_pool_idx, kv_len, slots[:1])
        self.kv_lens[req.rid] = kv_len + 1
        req.output_ids.append(sampled)
        return True

    def finish(self, req: Req) -> None:
        """Finished (or retracted) after sampling: every token but the last has KV."""
        assert not self.is_prefilling(req)
        self.cache.cache_finished_req(req)
        del self.kv_lens[req.rid]
        self.decoding.discard(req.rid)

    def abort(self, req: Req, committed_len: int) -> None:
        """Aborted with only `committed_len` of its allocated KV positions written."""
        self.cache.cache_finished_req(req, token_ids=req.all_ids()[:committed_len],
                                      allocated_len=self.kv_lens[req.rid])
        del self.kv_lens[req.rid]
        self.decoding.discard(req.rid)

    def owned_slots(self, req: Req, owns_prefix: bool) -> torch.Tensor:
        """Slots the request owns (not the cache's): all of them for ChunkCache."""
        start = 0 if owns_prefix else len(req.prefix_indices)
        return self.row(req)[start:self.kv_lens[req.rid]].to(torch.int64)
