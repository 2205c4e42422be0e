"""RadixCache: a radix tree over token ids whose values are KV slot indices (RadixAttention).

Tree invariants (checked by `check_invariants`):
  * the root holds no tokens and is always locked; every other node holds >= 1 token and
    `len(node.value) == len(node.key)`; `parent.children[child.key[0]] is child`.
  * a path root..node spells a token prefix; its values are the KV slots of those tokens.
  * `lock_ref` of a node counts the locks whose node lies in its subtree, so a parent's count is
    >= the sum of its children's; locked nodes are never evicted.
  * `evictable_size()` = tokens in nodes with lock_ref 0, `protected_size()` = tokens in nodes
    with lock_ref > 0, and their sum is `total_size()`.
  * every cached slot is a valid pool slot (1..size) and appears once.
Access times come from a per-cache counter (one tick per operation), not the wall clock, so
eviction order is deterministic: least recently used unlocked leaf first.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixserve.mem.base_cache import BasePrefixCache, MatchResult, empty_slots
from radixserve.mem.kv_pool import KVPool
from radixserve.mem.req_to_token_pool import ReqToTokenPool

if TYPE_CHECKING:
    from radixserve.core.req import Req


@dataclass(eq=False)
class TreeNode:
    node_id: int
    key: list[int] = field(default_factory=list, repr=False)
    value: torch.Tensor = field(default_factory=empty_slots, repr=False)
    parent: "TreeNode | None" = field(default=None, repr=False)
    children: dict[int, "TreeNode"] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access_time: int = 0
    # HybridRadixCache: the snapshot row holding the recurrent states after this node's last
    # token (None: none kept)
    state: int | None = None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _as_node(handle: object | None) -> TreeNode | None:
    """A handle from match_prefix is one of this tree's nodes (None: nothing matched)."""
    _require(handle is None or isinstance(handle, TreeNode), f"not a RadixCache handle: {handle!r}")
    return handle  # type: ignore[return-value]


def _common_prefix_len(node_key: list[int], key: list[int], start: int) -> int:
    """Length of the common prefix of `node_key` and `key[start:]`. Slice comparisons run in C:
    a whole-node match (the common case) is one comparison, a mismatch is found by halving the
    range, so a 100k-token prompt does not cost a Python loop over every token."""
    limit = min(len(node_key), len(key) - start)
    if node_key[:limit] == key[start:start + limit]:
        return limit
    lo, hi = 0, limit  # node_key[:lo] matches; the first mismatch is before hi
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if node_key[lo:mid] == key[start + lo:start + mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and node_key[lo] == key[start + lo]:
        lo += 1
    return lo


class RadixCache(BasePrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool,
                 token_to_kv_pool: KVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.reset()

    def reset(self) -> None:
        self._clock = itertools.count(1)
        self._node_ids = itertools.count()
        self.root = TreeNode(node_id=next(self._node_ids), lock_ref=1)
        self._evictable_size = 0
        self._protected_size = 0
        # unlocked childless nodes (root aside): eviction's candidates, kept as the tree changes
        # so an eviction does not walk the whole tree
        self._evictable_leaves: set[TreeNode] = set()
        # their LRU order, lazily: (last_access_time, node_id, seq, node) pushed whenever a node
        # becomes a candidate or is used while one; entries whose node has left the set or been
        # used since are stale and skipped, so an eviction pops O(k log n), not a heapify of
        # every candidate (a full cache evicts at every admission)
        self._lru_heap: list[tuple[int, int, int, TreeNode]] = []
        self._heap_seq = itertools.count()

    def _mark_evictable(self, node: TreeNode) -> None:
        self._evictable_leaves.add(node)
        self._push_lru(node)

    def _push_lru(self, node: TreeNode) -> None:
        self._push_lazy(self._lru_heap, self._evictable_leaves, node, slack=4096)

    def _push_lazy(self, heap: list[tuple[int, int, int, TreeNode]], members: set[TreeNode],
                   node: TreeNode, slack: int) -> None:
        """Push `node` by its last access onto a lazy LRU heap of `members`, rebuilt from them
        first when its entries outnumber them by more than twice plus `slack` (mostly
        stale)."""
        if len(heap) > 2 * len(members) + slack:
            heap[:] = [(n.last_access_time, n.node_id, next(self._heap_seq), n)
                       for n in members if n is not node]
            heapq.heapify(heap)
        heapq.heappush(heap, (node.last_access_time, node.node_id, next(self._heap_seq), node))

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access_time = now
        if node in self._evictable_leaves:
            self._push_lru(node)

    # ---- lookups and inserts ----
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key`. If it ends inside a node, that node is split so
        that the handle (a TreeNode) ends exactly at the prefix. Marks the path as just used."""
        return self._walk(key)

    def _walk(self, key: list[int]) -> MatchResult:
        """match_prefix of this class (a subclass's may stop short of the longest prefix)."""
        now = next(self._clock)
        node = self.root
        node.last_access_time = now
        values: list[torch.Tensor] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            match_len = _common_prefix_len(child.key, key, pos)
            if match_len < len(child.key):
                child = self._split(child, match_len)
            self._touch(child, now)
            values.append(child.value)
            node = child
            pos += match_len
        indices = torch.cat(values) if values else empty_slots()
        return MatchResult(indices=indices, handle=node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Cache `value[i]` as the KV slot of `key[:i+1]` for every i not cached yet.

        Returns the length of the prefix that was already cached: the tree keeps its own slots
        there, so the caller still owns `value[:returned]` and must free what it doesn't need.
        The tree takes ownership of `value[returned:]`.
        """
        _require(len(key) == len(value), f"key has {len(key)} tokens, value {len(value)}")
        value = value.to(device="cpu", dtype=torch.int64)
        now = next(self._clock)
        node = self.root
        node.last_access_time = now
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(node_id=next(self._node_ids), key=key[pos:],
                                value=value[pos:].clone(), parent=node, last_access_time=now)
                node.children[key[pos]] = leaf
                self._evictable_size += len(leaf.key)
                self._evictable_leaves.discard(node)
                self._mark_evictable(leaf)
                return pos
            match_len = _common_prefix_len(child.key, key, pos)
            if match_len < len(child.key):
                child = self._split(child, match_len)
            self._touch(child, now)
            node = child
            pos += match_len
        return pos

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child` after `split_len` tokens; return the new upper node. The upper part
        inherits the lock count (the same locks pass through it), so sizes are unchanged."""
        parent = child.parent
        assert parent is not None and 0 < split_len < len(child.key)
        upper = TreeNode(node_id=next(self._node_ids), key=child.key[:split_len],
                         value=child.value[:split_len].clone(), parent=parent,
                         lock_ref=child.lock_ref, last_access_time=child.last_access_time)
        upper.children[child.key[split_len]] = child
        parent.children[child.key[0]] = upper
        child.key = child.key[split_len:]
        child.value = child.value[split_len:].clone()
        child.parent = upper
        return upper

    # ---- requests ----
    def _read_row(self, req: "Req", length: int) -> torch.Tensor:
        _require(req.req_pool_idx is not None, f"{req!r} holds no ReqToTokenPool row")
        return self.req_to_token_pool.read_row(req.req_pool_idx, length)

    def cache_finished_req(self, req: "Req", token_ids: list[int] | None = None,
                           allocated_len: int | None = None) -> None:
        if token_ids is None:
            token_ids = req.all_ids()[:-1]
        token_ids = req.cache_key(token_ids)
        kv_len = len(token_ids)
        allocated_len = kv_len if allocated_len is None else allocated_len
        prefix_len = len(req.prefix_indices)
        _require(prefix_len <= kv_len <= allocated_len,
                 f"need prefix {prefix_len} <= kv {kv_len} <= allocated {allocated_len}")
        row = self._read_row(req, allocated_len)
        already_len = self.insert(token_ids, row[:kv_len])
        _require(already_len >= prefix_len, "token_ids do not start with the matched prefix")
        # [0, prefix_len): the tree's own slots. [prefix_len, already_len): slots of KV the
        # tree already had (another request cached it meanwhile). [kv_len, allocated_len):
        # allocated, never written.
        self.token_to_kv_pool.free(torch.cat((row[prefix_len:already_len],
                                              row[kv_len:allocated_len])))
        self.req_to_token_pool.free(req.req_pool_idx)
        self.dec_lock_ref(req.cache_handle)
        req.req_pool_idx = None
        req.cache_handle = None
        req.prefix_indices = empty_slots()

    def cache_unfinished_req(self, req: "Req", token_ids: list[int] | None = None) -> None:
        if token_ids is None:
            token_ids = req.fill_ids
        token_ids = req.cache_key(token_ids)
        kv_len = len(token_ids)
        prefix_len = len(req.prefix_indices)
        _require(prefix_len <= kv_len, f"prefix {prefix_len} longer than kv {kv_len}")
        row = self._read_row(req, kv_len)
        already_len = self.insert(token_ids, row)
        _require(already_len >= prefix_len, "token_ids do not start with the matched prefix")
        self.token_to_kv_pool.free(row[prefix_len:already_len])
        new_indices, new_handle = self._walk(token_ids)
        _require(len(new_indices) == kv_len, "just-inserted tokens are not all cached")
        # point the freed duplicate positions at the tree's slots; the rest are unchanged
        self.req_to_token_pool.write(req.req_pool_idx, prefix_len,
                                     new_indices[prefix_len:already_len])
        self.inc_lock_ref(new_handle)
        self.dec_lock_ref(req.cache_handle)
        req.prefix_indices = new_indices
        req.cache_handle = new_handle

    # ---- locking ----
    def inc_lock_ref(self, handle: object | None) -> int:
        node = _as_node(handle)
        delta = 0
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta -= len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, handle: object | None) -> int:
        node = _as_node(handle)
        delta = 0
        while node is not None and node is not self.root:
            _require(node.lock_ref > 0, f"unbalanced dec_lock_ref on {node!r}")
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta += len(node.key)
                if not node.children:
                    self._mark_evictable(node)
            node.lock_ref -= 1
            node = node.parent
        return delta

    # ---- eviction ----
    def evict(self, num_tokens: int) -> int:
        """Evict least-recently-used unlocked leaves (a parent left childless becomes a
        candidate) until `num_tokens` are freed or nothing is evictable. Whole nodes are
        evicted, so more than `num_tokens` may be freed. Returns the number freed."""
        if num_tokens <= 0:
            return 0
        heap, leaves = self._lru_heap, self._evictable_leaves
        freed: list[torch.Tensor] = []
        freed_len = 0
        while freed_len < num_tokens and heap:
            used_at, _, _, node = heapq.heappop(heap)
            if node not in leaves or node.last_access_time != used_at:
                continue  # stale: no longer a candidate, or used since (a newer entry exists)
            leaves.discard(node)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.parent = None
            freed.append(node.value)
            self._on_evicted(node)
            freed_len += len(node.key)
            self._evictable_size -= len(node.key)
            if not parent.children and parent.lock_ref == 0 and parent is not self.root:
                self._mark_evictable(parent)
        if freed:
            self.token_to_kv_pool.free(torch.cat(freed))
        return freed_len

    def _on_evicted(self, node: TreeNode) -> None:
        """A node just left the tree (its KV slots are freed by the caller)."""

    # ---- sizes and introspection ----
    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def cached_slots(self) -> torch.Tensor:
        values = [n.value for n in self._nodes() if n is not self.root]
        return torch.cat(values) if values else empty_slots()

    def _nodes(self) -> list[TreeNode]:
        """Every node, root first, parents before children."""
        nodes = [self.root]
        i = 0
        while i < len(nodes):
            nodes.extend(nodes[i].children.values())
            i += 1
        return nodes

    def check_invariants(self) -> None:
        root = self.root
        _require(not root.key and root.value.numel() == 0 and root.parent is None,
                 "root must hold no tokens")
        _require(root.lock_ref == 1, f"root lock_ref is {root.lock_ref}, expected 1")
        evictable = protected = 0
        leaves = {n for n in self._nodes()
                  if not n.children and n.lock_ref == 0 and n is not root}
        _require(leaves == self._evictable_leaves, "the evictable-leaf set is out of date")
        ordered = {id(n) for t, _, _, n in self._lru_heap
                   if n in leaves and n.last_access_time == t}
        _require(all(id(n) in ordered for n in leaves),
                 "an evictable leaf has no current entry in the LRU heap")
        for node in self._nodes():
            _require(node.lock_ref >= 0, f"negative lock_ref on {node!r}")
            children_locks = 0
            for first, child in node.children.items():
                _require(child.parent is node, f"{child!r} has a wrong parent")
                _require(len(child.key) > 0 and child.key[0] == first,
                         f"{child!r} is keyed by {first} but starts with {child.key[:1]}")
                children_locks += child.lock_ref
            if node is root:
                continue
            _require(node.lock_ref >= children_locks,
                     f"{node!r} has lock_ref {node.lock_ref} < children's {children_locks}")
            _require(node.value.dtype == torch.int64 and node.value.dim() == 1
                     and len(node.value) == len(node.key),
                     f"{node!r}: {len(node.key)} tokens but value {tuple(node.value.shape)}")
            if node.lock_ref == 0:
                evictable += len(node.key)
            else:
                protected += len(node.key)
        _require(evictable == self._evictable_size,
                 f"evictable_size {self._evictable_size}, tree has {evictable}")
        _require(protected == self._protected_size,
                 f"protected_size {self._protected_size}, tree has {protected}")
        slots = self.cached_slots()
        if slots.numel():
            _require(int(slots.min()) >= 1 and int(slots.max()) <= self.token_to_kv_pool.size,
                     "a cached slot is outside 1..pool size")
            _require(slots.unique().numel() == slots.numel(), "a KV slot is cached twice")

    def format_tree(self) -> str:
        lines = [f"RadixCache total={self.total_size()} evictable={self._evictable_size} "
                 f"protected={self._protected_size}"]
        stack = [(child, 1) for child in reversed(self.root.children.values())]
        while stack:
            node, depth = stack.pop()
            shown = " ".join(map(str, node.key[:8])) + (" ..." if len(node.key) > 8 else "")
            lines.append(f"{'  ' * depth}[{shown}] len={len(node.key)} "
                         f"lock={node.lock_ref} t={node.last_access_time}")
            stack.extend((child, depth + 1) for child in reversed(node.children.values()))
        return "\n".join(lines)
