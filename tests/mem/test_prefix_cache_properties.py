"""Property-based (hypothesis stateful) tests of RadixCache and ChunkCache with real pools.

Random admissions (chunked), decodes, finishes, retractions, aborts, raw inserts, matches,
locks and evictions over a 4-token vocabulary, so prefixes collide all the time. After every step:
  * tree invariants (`check_invariants`), evictable + protected == total;
  * slot conservation: pool free list + cached slots + slots owned by live requests is exactly
    1..pool size (nothing lost, nothing in two places);
  * the tree agrees with a reference map {token prefix: KV slot} kept by the test from what was
    inserted (entries only ever disappear through eviction, never change);
  * every live request's prefix is still cached, and protected_size equals the number of cached
    tokens on locked paths.
"""
from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mem_cache_sim import MiniScheduler, make_pools, make_req
from radixserve.core.req import Req
from radixserve.mem.base_cache import BasePrefixCache
from radixserve.mem.chunk_cache import ChunkCache
from radixserve.mem.radix_cache import RadixCache, TreeNode

KV_SIZE = 24
MAX_SEQ_LEN = 16
tokens = st.integers(0, 3)
prompts = st.lists(tokens, min_size=1, max_size=10)
chunk_lens = st.integers(1, 4)
picks = st.integers(0, 1 << 16)

Prefix = tuple[int, ...]


def node_path(node: TreeNode) -> list[int]:
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


class PrefixCacheMachine(RuleBasedStateMachine):
    use_radix = True

    def __init__(self) -> None:
        super().__init__()
        self.req_pool, self.kv_pool = make_pools(kv_size=KV_SIZE, req_slots=4,
                                                 max_context_len=32)
        cache_cls = RadixCache if self.use_radix else ChunkCache
        self.cache: BasePrefixCache = cache_cls(self.req_pool, self.kv_pool)
        self.sched = MiniScheduler(self.cache, self.req_pool, self.kv_pool)
        self.live: list[Req] = []
        self.waiting: list[Req] = []  # retracted, to be admitted again
        self.held_locks: list[tuple[Prefix, TreeNode]] = []
        self.ref: dict[Prefix, int] = {}  # what the tree must hold (radix only)
        self.num_reqs = 0

    # ---- reference model ----
    def tree_map(self) -> dict[Prefix, int]:
        assert isinstance(self.cache, RadixCache)
        out: dict[Prefix, int] = {}
        stack: list[tuple[TreeNode, Prefix]] = [(self.cache.root, ())]
        while stack:
            node, path = stack.pop()
            for i, slot in enumerate(node.value.tolist()):
                out[path + tuple(node.key[:i + 1])] = slot
            stack.extend((child, path + tuple(node.key)) for child in node.children.values())
        return out

    def sync_ref(self, strict: bool) -> None:
        """The tree may only lose entries (eviction) unless `strict`; it never changes one."""
        if not self.use_radix:
            return
        tree = self.tree_map()
        assert all(self.ref.get(k) == v for k, v in tree.items()), "tree changed/invented"
        assert not strict or len(tree) == len(self.ref), "tree lost entries"
        self.ref = tree

    def cached_len(self, key: list[int]) -> int:
        n = 0
        while n < len(key) and tuple(key[:n + 1]) in self.ref:
            n += 1
        return n

    def free_counter(self) -> Counter[int]:
        return Counter(self.kv_pool.free_slots.tolist())

    # ---- checked cache calls ----
    def checked_finish(self, req: Req, token_ids: list[int] | None = None) -> None:
        self.sync_ref(strict=False)
        kv_len, prefix_len = self.sched.kv_lens[req.rid], len(req.prefix_indices)
        keys = req.all_ids()[:-1] if token_ids is None else token_ids
        row = self.sched.row(req)[:kv_len].tolist()
        present = self.cached_len(keys)
        if self.use_radix:
            expected_freed = row[prefix_len:present] + row[len(keys):kv_len]
        else:
            expected_freed = row
        before = self.free_counter()
        if token_ids is None:
            self.sched.finish(req)
        else:
            self.sched.abort(req, len(token_ids))
        assert self.free_counter() - before == Counter(expected_freed)
        assert not before - self.free_counter()
        assert req.req_pool_idx is None and req.prefix_indices.numel() == 0
        if self.use_radix:
            for i in range(present, len(keys)):
                self.ref[tuple(keys[:i + 1])] = row[i]
        self.sync_ref(strict=True)
        self.live.remove(req)

    def checked_prefill(self, req: Req, sampled: int) -> None:
        """The current chunk ran; a non-final chunk goes through cache_unfinished_req."""
        self.sync_ref(strict=False)
        keys, prefix_len = req.fill_ids, len(req.prefix_indices)
        final = self.sched.kv_lens[req.rid] == len(req.all_ids())
        row = self.sched.row(req)[:len(keys)].tolist()
        present = self.cached_len(keys) if self.use_radix else 0
        expected_row = [self.ref[tuple(keys[:i + 1])] for i in range(present)] + row[present:]
        before = self.free_counter()
        self.sched.run_prefill(req, sampled)
        if final:
            assert self.free_counter() == before
            return
        assert self.free_counter() - before == Counter(row[prefix_len:present])
        assert self.sched.row(req)[:len(keys)].tolist() == expected_row
        assert req.prefix_indices.tolist() == expected_row
        if self.use_radix:
            for i in range(present, len(keys)):
                self.ref[tuple(keys[:i + 1])] = row[i]
        self.sync_ref(strict=True)

    def admit(self, req: Req, chunk_len: int, sampled: int) -> bool:
        self.sync_ref(strict=False)
        expected_prefix = self.cached_len(req.all_ids()[:-1]) if self.use_radix else 0
        if not self.sched.admit(req, chunk_len):
            return False
        # admission may have evicted, but never the prefix it just locked
        assert len(req.prefix_indices) == expected_prefix
        self.live.append(req)
        self.checked_prefill(req, sampled)
        return True

    def pick(self, reqs: list[Req], index: int) -> Req:
        return reqs[index % len(reqs)]

    def prefilling(self) -> list[Req]:
        return [r for r in self.live if self.sched.is_prefilling(r)]

    def decoding(self) -> list[Req]:
        return [r for r in self.live if not self.sched.is_prefilling(r)]

    # ---- rules: requests ----
    @rule(prompt=prompts, chunk_len=chunk_lens, sampled=tokens)
    def admit_new(self, prompt: list[int], chunk_len: int, sampled: int) -> None:
        self.num_reqs += 1
        self.admit(make_req(f"r{self.num_reqs}", prompt), chunk_len, sampled)

    @precondition(lambda self: self.live)
    @rule(index=picks, chunk_len=chunk_lens, sampled=tokens)
    def admit_same_prompt(self, index: int, chunk_len: int, sampled: int) -> None:
        """Identical prompts in flight at once: one's KV duplicates the other's."""
        self.num_reqs += 1
        prompt = self.pick(self.live, index).origin_input_ids
        self.admit(make_req(f"r{self.num_reqs}", prompt), chunk_len, sampled)

    @precondition(lambda self: self.waiting)
    @rule(index=picks, chunk_len=chunk_lens, sampled=tokens)
    def admit_retracted(self, index: int, chunk_len: int, sampled: int) -> None:
        req = self.pick(self.waiting, index)
        if self.admit(req, chunk_len, sampled):
            self.waiting.remove(req)

    @precondition(lambda self: self.prefilling())
    @rule(index=picks, chunk_len=chunk_lens, sampled=tokens)
    def next_chunk(self, index: int, chunk_len: int, sampled: int) -> None:
        req = self.pick(self.prefilling(), index)
        if self.sched.next_chunk(req, chunk_len):
            self.checked_prefill(req, sampled)

    @precondition(lambda self: self.decoding())
    @rule(index=picks, sampled=tokens)
    def decode(self, index: int, sampled: int) -> None:
        req = self.pick(self.decoding(), index)
        if len(req.all_ids()) >= MAX_SEQ_LEN or not self.sched.decode(req, sampled):
            self.checked_finish(req)  # out of room: retract (its KV stays cached)
            self.waiting.append(req)

    @precondition(lambda self: self.decoding())
    @rule(index=picks, retract=st.booleans())
    def finish(self, index: int, retract: bool) -> None:
        req = self.pick(self.decoding(), index)
        self.checked_finish(req)
        if retract:
            self.waiting.append(req)

    @precondition(lambda self: self.live)
    @rule(index=picks, committed=picks)
    def abort(self, index: int, committed: int) -> None:
        req = self.pick(self.live, index)
        low, high = len(req.prefix_indices), self.sched.kv_lens[req.rid]
        self.checked_finish(req, req.all_ids()[:low + committed % (high - low + 1)])

    # ---- rules: the cache directly ----
    @precondition(lambda self: self.use_radix)
    @rule(key=prompts)
    def insert(self, key: list[int]) -> None:
        value = self.sched.alloc_kv(len(key))
        if value is None:
            return
        self.sync_ref(strict=False)
        present = self.cached_len(key)
        assert isinstance(self.cache, RadixCache)
        assert self.cache.insert(key, value) == present
        self.kv_pool.free(value[:present])
        for i in range(present, len(key)):
            self.ref[tuple(key[:i + 1])] = int(value[i])
        self.sync_ref(strict=True)

    @precondition(lambda self: self.use_radix and self.prefilling())
    @rule(index=picks)
    def insert_prompt_of_prefilling_req(self, index: int) -> None:
        """Someone caches the rest of a chunked request's prompt before its next chunk."""
        self.insert(self.pick(self.prefilling(), index).all_ids())

    @rule(key=st.lists(tokens, max_size=10))
    def match(self, key: list[int]) -> None:
        self.sync_ref(strict=False)
        indices, node = self.cache.match_prefix(key)
        expected = [self.ref[tuple(key[:i + 1])] for i in range(self.cached_len(key))]
        assert indices.dtype == torch.int64 and indices.tolist() == expected
        if self.use_radix:
            assert node_path(node) == key[:len(expected)]
        self.sync_ref(strict=True)  # a split changes no mapping

    @precondition(lambda self: self.use_radix)
    @rule(key=prompts)
    def lock(self, key: list[int]) -> None:
        indices, node = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(node)
        self.held_locks.append((tuple(key[:len(indices)]), node))

    @precondition(lambda self: self.held_locks)
    @rule(index=picks)
    def unlock(self, index: int) -> None:
        _, node = self.held_locks.pop(index % len(self.held_locks))
        self.cache.dec_lock_ref(node)

    @rule(num_tokens=st.integers(0, KV_SIZE))
    def evict(self, num_tokens: int) -> None:
        evictable, free = self.cache.evictable_size(), self.kv_pool.available_size()
        freed = self.cache.evict(num_tokens)
        assert freed == evictable - self.cache.evictable_size()
        assert freed == self.kv_pool.available_size() - free
        assert freed >= num_tokens or self.cache.evictable_size() == 0

    # ---- invariants ----
    @invariant()
    def tree_is_consistent(self) -> None:
        self.cache.check_invariants()
        assert self.cache.evictable_size() + self.cache.protected_size() \
            == self.cache.total_size() == self.cache.cached_slots().numel()
        self.sync_ref(strict=False)

    @invariant()
    def slots_are_conserved(self) -> None:
        owned = [self.sched.owned_slots(r, owns_prefix=not self.use_radix) for r in self.live]
        everything = torch.cat([self.kv_pool.free_slots, self.cache.cached_slots(), *owned])
        assert sorted(everything.tolist()) == list(range(1, KV_SIZE + 1))
        rows = self.req_pool.free_slots + [r.req_pool_idx for r in self.live]
        assert sorted(rows) == list(range(self.req_pool.size))
        assert all(r.req_pool_idx is None for r in self.waiting)

    @invariant()
    def live_prefixes_are_cached_and_locked(self) -> None:
        locked: set[Prefix] = set()
        for req in self.live:
            prefix = req.prefix_indices.tolist()
            assert self.sched.row(req)[:len(prefix)].tolist() == prefix
            if not self.use_radix:
                continue
            key = req.all_ids()[:len(prefix)]
            assert [self.ref[tuple(key[:i + 1])] for i in range(len(key))] == prefix
            assert req.cache_handle is not None and node_path(req.cache_handle) == key
            locked.update(tuple(key[:i + 1]) for i in range(len(key)))
        for key, node in self.held_locks:
            assert node_path(node) == list(key)
            locked.update(key[:i + 1] for i in range(len(key)))
        if self.use_radix:
            assert self.cache.protected_size() == len(locked)
        else:
            assert self.cache.protected_size() == self.cache.total_size() == 0


class ChunkCacheMachine(PrefixCacheMachine):
    use_radix = False


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestRadixCacheStateful = PrefixCacheMachine.TestCase
TestRadixCacheStateful.settings = _settings
TestChunkCacheStateful = ChunkCacheMachine.TestCase
TestChunkCacheStateful.settings = settings(_settings, max_examples=60)
