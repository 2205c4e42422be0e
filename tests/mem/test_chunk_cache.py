"""Unit tests for ChunkCache (--disable-radix-cache): nothing is reused, everything is freed."""
from __future__ import annotations

from mem_cache_sim import MiniScheduler, make_pools, make_req
from radixserve.mem.chunk_cache import ChunkCache


def test_nothing_is_reused_and_finish_frees_everything() -> None:
    req_pool, kv_pool = make_pools(kv_size=16, req_slots=2)
    cache = ChunkCache(req_pool, kv_pool)
    sched = MiniScheduler(cache, req_pool, kv_pool)
    a = make_req("a", [1, 2, 3])
    assert sched.admit(a, chunk_len=100)
    sched.run_prefill(a, 4)
    sched.decode(a, 5)
    sched.finish(a)
    assert kv_pool.available_size() == 16 and req_pool.available_size() == 2
    assert a.req_pool_idx is None and a.cache_handle is None

    b = make_req("b", [1, 2, 3])
    indices, node = cache.match_prefix([1, 2, 3])
    assert indices.numel() == 0 and node is cache.root
    assert cache.inc_lock_ref(node) == 0 and cache.dec_lock_ref(node) == 0
    assert sched.admit(b, chunk_len=100) and b.prefix_indices.numel() == 0
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)
    assert cache.evict(100) == 0 and kv_pool.available_size() == 13
    cache.check_invariants()


def test_chunked_prefill_keeps_own_slots_as_prefix() -> None:
    req_pool, kv_pool = make_pools(kv_size=16, req_slots=2)
    cache = ChunkCache(req_pool, kv_pool)
    sched = MiniScheduler(cache, req_pool, kv_pool)
    a = make_req("a", [1, 2, 3, 4, 5])
    assert sched.admit(a, chunk_len=2)
    sched.run_prefill(a, 0)  # cache_unfinished_req
    first = sched.row(a)[:2].tolist()
    assert a.prefix_indices.tolist() == first and a.req_pool_idx is not None
    assert kv_pool.available_size() == 14
    assert sched.next_chunk(a, chunk_len=2)
    sched.run_prefill(a, 0)
    assert a.prefix_indices.tolist()[:2] == first and len(a.prefix_indices) == 4
    assert kv_pool.available_size() == 12
    sched.abort(a, committed_len=4)
    assert kv_pool.available_size() == 16 and req_pool.available_size() == 2
    cache.check_invariants()
    assert "disabled" in cache.format_tree()
