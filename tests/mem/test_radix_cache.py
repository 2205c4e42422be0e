"""Unit tests for RadixCache: split, insert, locks, LRU eviction, request caching."""
from __future__ import annotations

import torch

from mem_cache_sim import MiniScheduler, make_pools, make_req
from radixserve.mem.radix_cache import RadixCache


def new_cache(kv_size: int = 64) -> RadixCache:
    req_pool, kv_pool = make_pools(kv_size=kv_size)
    return RadixCache(req_pool, kv_pool)


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def insert_fresh(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert `key` with newly allocated slots, freeing the duplicates like a caller must."""
    value = cache.token_to_kv_pool.alloc(len(key))
    assert value is not None
    present = cache.insert(key, value)
    cache.token_to_kv_pool.free(value[:present])
    return value


def free_set(cache: RadixCache) -> set[int]:
    return set(cache.token_to_kv_pool.free_slots.tolist())


def test_empty_key_matches_root() -> None:
    cache = new_cache()
    cache.insert([1, 2], slots(5, 6))
    indices, node = cache.match_prefix([])
    assert indices.numel() == 0 and indices.dtype == torch.int64
    assert node is cache.root
    assert cache.insert([], slots()) == 0


def test_match_splits_inside_node() -> None:
    cache = new_cache()
    cache.insert([1, 2, 3, 4], slots(11, 12, 13, 14))
    indices, node = cache.match_prefix([1, 2, 9])
    assert indices.tolist() == [11, 12]
    assert node.key == [1, 2] and node.value.tolist() == [11, 12]
    assert list(node.children) == [3] and node.children[3].key == [3, 4]
    assert node.children[3].value.tolist() == [13, 14]
    assert cache.root.children[1] is node
    cache.check_invariants()
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == [11, 12, 13, 14]
    assert cache.total_size() == 4 == cache.evictable_size()


def test_insert_returns_already_present_len_and_keeps_old_slots() -> None:
    cache = new_cache()
    assert cache.insert([1, 2, 3], slots(1, 2, 3)) == 0
    assert cache.insert([1, 2, 3, 4, 5], slots(9, 9, 9, 4, 5)) == 3
    assert cache.insert([1, 2, 7], slots(9, 9, 7)) == 2
    assert cache.insert([1, 2], slots(9, 9)) == 2
    assert cache.insert([1, 2, 3, 4, 5], slots(9, 9, 9, 9, 9)) == 5
    assert cache.insert([8], slots(8)) == 0
    cache.check_invariants()
    # the tree kept the first slots it saw for every prefix
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == [1, 2, 3, 4, 5]
    assert cache.match_prefix([1, 2, 7]).indices.tolist() == [1, 2, 7]
    assert cache.match_prefix([8, 1]).indices.tolist() == [8]
    assert cache.total_size() == 7
    assert sorted(cache.cached_slots().tolist()) == [1, 2, 3, 4, 5, 7, 8]


def test_insert_does_not_alias_caller_tensor() -> None:
    cache = new_cache()
    value = slots(1, 2, 3)
    cache.insert([1, 2, 3], value)
    value[:] = 0
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == [1, 2, 3]


def test_lock_and_unlock_sizes() -> None:
    cache = new_cache()
    cache.insert([1, 2, 3, 4], slots(1, 2, 3, 4))
    _, node = cache.match_prefix([1, 2])
    assert cache.inc_lock_ref(node) == -2
    assert (cache.evictable_size(), cache.protected_size()) == (2, 2)
    assert cache.inc_lock_ref(node) == 0  # already locked: sizes unchanged
    cache.insert([1, 2, 5, 6], slots(5, 6, 7, 8))
    assert (cache.evictable_size(), cache.protected_size()) == (4, 2)
    cache.check_invariants()
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 2
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)
    cache.check_invariants()


def test_split_of_locked_node_keeps_lock_on_both_parts() -> None:
    cache = new_cache()
    cache.insert([1, 2, 3, 4], slots(1, 2, 3, 4))
    _, leaf = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(leaf)
    _, upper = cache.match_prefix([1, 2])  # splits the locked node
    assert upper.lock_ref == 1 and leaf.lock_ref == 1 and leaf.parent is upper
    assert cache.protected_size() == 4
    cache.check_invariants()
    assert cache.evict(10) == 0
    assert cache.dec_lock_ref(leaf) == 4
    assert upper.lock_ref == 0
    cache.check_invariants()


def test_unbalanced_unlock_raises() -> None:
    cache = new_cache()
    cache.insert([1], slots(1))
    _, node = cache.match_prefix([1])
    try:
        cache.dec_lock_ref(node)
    except AssertionError:
        return
    raise AssertionError("dec_lock_ref on an unlocked node must raise")


def test_evict_is_lru_and_frees_slots() -> None:
    cache = new_cache()
    a = insert_fresh(cache, [1, 1])
    b = insert_fresh(cache, [2, 2])
    c = insert_fresh(cache, [3, 3])
    cache.match_prefix([1, 1])  # a is now the most recently used
    before = free_set(cache)
    assert cache.evict(1) == 2  # whole leaf: b
    assert free_set(cache) == before | set(b.tolist())
    assert cache.match_prefix([2, 2]).indices.numel() == 0
    assert cache.evict(2) == 2  # c
    assert free_set(cache) == before | set(b.tolist()) | set(c.tolist())
    assert cache.match_prefix([1, 1]).indices.tolist() == a.tolist()
    assert cache.evict(100) == 2
    assert cache.total_size() == 0 and cache.evict(1) == 0
    assert len(free_set(cache)) == cache.token_to_kv_pool.size
    cache.check_invariants()


def test_evict_reaches_parent_once_children_are_gone() -> None:
    cache = new_cache()
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 2, 4])  # splits: [1, 2] -> {[3], [4]}
    insert_fresh(cache, [5])
    assert cache.evict(1) == 1  # oldest leaf: [3]
    assert cache.match_prefix([1, 2, 3]).indices.numel() == 2
    cache.match_prefix([1, 2, 4])  # touches [1, 2] and [4]: now [5] is the oldest
    assert cache.evict(1) == 1
    assert cache.match_prefix([5]).indices.numel() == 0
    assert cache.evict(2) == 3  # [4] (1 token), then its parent [1, 2] (2 tokens)
    assert cache.total_size() == 0
    cache.check_invariants()


def test_eviction_order_survives_many_uses_between_evictions() -> None:
    """Every use of a candidate leaves a stale entry in the lazy LRU heap (and enough of them
    make it rebuild): the order evicted is still least recently used first, against a
    brute-force LRU of the same uses."""
    import random
    cache = new_cache(kv_size=400)
    keys = [[i, i] for i in range(1, 101)]
    for key in keys:
        insert_fresh(cache, key)
    rng = random.Random(0)
    last_use = {k[0]: t for t, k in enumerate(keys)}
    for t in range(len(keys), len(keys) + 6000):  # enough stale entries to force rebuilds
        key = rng.choice(keys[:60])
        cache.match_prefix(key)
        last_use[key[0]] = t
    cache.check_invariants()
    order = sorted(last_use, key=last_use.get)  # least recently used first
    for victim in order[:50]:
        assert cache.evict(1) == 2
        # a miss touches nothing, so the order of the rest is unchanged
        assert cache.match_prefix([victim, victim]).indices.numel() == 0, victim
    assert all(cache.match_prefix([k, k]).indices.numel() == 2 for k in order[50:])
    cache.check_invariants()


def test_evict_skips_locked_path() -> None:
    cache = new_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)
    assert cache.evict(100) == 2  # [4] and [5]; [1, 2] and [3] are locked
    assert cache.match_prefix([1, 2, 3, 4]).indices.numel() == 3
    assert (cache.evictable_size(), cache.protected_size()) == (0, 3)
    cache.check_invariants()


def test_finished_requests_share_prefix_and_free_duplicates() -> None:
    req_pool, kv_pool = make_pools(kv_size=32, req_slots=4)
    cache = RadixCache(req_pool, kv_pool)
    sched = MiniScheduler(cache, req_pool, kv_pool)
    a, b = make_req("a", [1, 2, 3, 4]), make_req("b", [1, 2, 3, 4])
    assert sched.admit(a, chunk_len=100) and sched.admit(b, chunk_len=100)  # both miss
    sched.run_prefill(a, 5)
    sched.run_prefill(b, 5)
    sched.decode(a, 6)
    a_row = sched.row(a)[:5].tolist()
    b_row = sched.row(b)[:5].tolist()
    assert kv_pool.available_size() == 32 - 9
    sched.finish(a)  # caches [1, 2, 3, 4, 5] (6 never had KV)
    assert a.req_pool_idx is None and a.cache_handle is None and req_pool.available_size() == 3
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == a_row
    assert kv_pool.available_size() == 32 - 9
    sched.finish(b)  # caches [1, 2, 3, 4]: all present already, b's 4 slots are duplicates
    assert set(kv_pool.free_slots.tolist()) >= set(b_row[:4])
    assert kv_pool.available_size() == 32 - 5 and req_pool.available_size() == 4
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    cache.check_invariants()

    c = make_req("c", [1, 2, 3, 9, 9])
    assert sched.admit(c, chunk_len=100)
    assert c.prefix_indices.tolist() == a_row[:3]
    assert sched.row(c)[:3].tolist() == a_row[:3]
    assert cache.protected_size() == 3
    sched.run_prefill(c, 7)
    sched.finish(c)
    assert cache.match_prefix([1, 2, 3, 9, 9]).indices.tolist()[:3] == a_row[:3]
    assert cache.total_size() == 7 and cache.protected_size() == 0
    assert kv_pool.available_size() == 32 - 7
    cache.check_invariants()


def test_chunked_prefill_moves_lock_and_adopts_tree_slots() -> None:
    req_pool, kv_pool = make_pools(kv_size=32, req_slots=4)
    cache = RadixCache(req_pool, kv_pool)
    sched = MiniScheduler(cache, req_pool, kv_pool)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7])
    assert sched.admit(a, chunk_len=3)
    first_slots = sched.row(a)[:3].tolist()
    sched.run_prefill(a, 0)  # not the last chunk: cache_unfinished_req
    assert a.prefix_indices.tolist() == first_slots and a.fill_ids == [1, 2, 3]
    assert a.req_pool_idx is not None and cache.protected_size() == 3
    first_node = a.cache_handle
    assert first_node is not None and first_node.lock_ref == 1

    # meanwhile another request caches [1..5] with its own slots
    b = make_req("b", [1, 2, 3, 4, 5, 6])
    assert sched.admit(b, chunk_len=100)
    assert b.prefix_indices.tolist() == first_slots
    sched.run_prefill(b, 0)
    b_slots = sched.row(b)[:6].tolist()
    sched.finish(b)  # tree: [1, 2, 3] (a's slots) + [4, 5, 6] (b's slots)

    assert sched.next_chunk(a, chunk_len=3)
    a_own = sched.row(a)[3:6].tolist()
    free_before = set(kv_pool.free_slots.tolist())
    sched.run_prefill(a, 0)
    # a's slots for 4, 5, 6 were duplicates: freed, and its row now points at b's
    assert set(kv_pool.free_slots.tolist()) == free_before | set(a_own)
    assert sched.row(a)[:6].tolist() == first_slots + b_slots[3:6]
    assert a.prefix_indices.tolist() == first_slots + b_slots[3:6]
    assert first_node.lock_ref == 1  # the old lock moved to the new last node (below it)
    assert a.cache_handle is not first_node and a.cache_handle.lock_ref == 1
    assert cache.protected_size() == 6
    cache.check_invariants()

    assert sched.next_chunk(a, chunk_len=3)  # last chunk: token 7
    sched.run_prefill(a, 8)
    sched.finish(a)
    assert cache.match_prefix(list(range(1, 9))).indices.numel() == 7
    assert (cache.protected_size(), kv_pool.available_size()) == (0, 32 - 7)
    cache.check_invariants()


def test_abort_caches_committed_kv_and_frees_the_rest() -> None:
    req_pool, kv_pool = make_pools(kv_size=16, req_slots=2)
    cache = RadixCache(req_pool, kv_pool)
    sched = MiniScheduler(cache, req_pool, kv_pool)
    a = make_req("a", [1, 2, 3, 4, 5])
    assert sched.admit(a, chunk_len=100)
    row = sched.row(a)[:5].tolist()
    sched.abort(a, committed_len=2)  # 5 slots allocated, only 2 written
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == row[:2]
    assert kv_pool.available_size() == 16 - 2 and req_pool.available_size() == 2
    assert set(row[2:]) <= set(kv_pool.free_slots.tolist())
    cache.check_invariants()


def test_reset_and_pretty_print(capsys) -> None:  # type: ignore[no-untyped-def]
    cache = new_cache()
    cache.insert([1, 2, 3], slots(1, 2, 3))
    cache.insert([1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12], slots(*range(4, 15)))
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "total=12" in out and "[1 2]" in out and "..." in out
    cache.reset()
    assert cache.total_size() == 0 and cache.match_prefix([1]).indices.numel() == 0
    cache.check_invariants()


def test_common_prefix_len_matches_a_token_by_token_scan() -> None:
    import random

    from radixserve.mem.radix_cache import _common_prefix_len

    def scan(node_key: list[int], key: list[int], start: int) -> int:
        i = 0
        while i < min(len(node_key), len(key) - start) and node_key[i] == key[start + i]:
            i += 1
        return i

    rng = random.Random(0)
    for _ in range(3000):
        node_key = [rng.randrange(3) for _ in range(rng.randrange(0, 300))]
        key = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        key += node_key[:rng.randrange(0, len(node_key) + 1)]
        key += [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        start = rng.randrange(0, len(key) + 1)
        assert _common_prefix_len(node_key, key, start) == scan(node_key, key, start)
