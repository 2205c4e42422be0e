"""Which waiting request goes first: lpm | fcfs | dfs-weight | random.

The cache-aware policies match every waiting request against the radix cache (which also fills
req.prefix_indices / req.cache_handle for admission). Like SGLang v0.2, lpm falls back to fcfs when
the queue is long, because matching every request each turn would cost more than it saves. The
other orders match nothing: the scheduler matches each request as admission reaches it
(`SchedulePolicy.matches_all` says which), so a turn over a queue of thousands matches only the
requests it admits and the one that stops it.
"""
from __future__ import annotations

import random
from collections import defaultdict
from typing import TYPE_CHECKING

from radixserve.core.req import Req

if TYPE_CHECKING:
    from radixserve.mem.base_cache import BasePrefixCache
    from radixserve.scheduler.priority import PriorityOrder

LPM_MAX_QUEUE_LEN = 128


def match_prefix(req: Req, tree_cache: "BasePrefixCache") -> None:
    """Fill req.prefix_indices / cache_handle / extend_input_len from the cache."""
    req.init_next_round_input()
    # the last token must be recomputed to produce logits, so never match the whole sequence
    indices, cache_handle = tree_cache.match_prefix(req.cache_key(req.fill_ids[:-1]))
    if req.return_logprob and req.logprob_start_len >= 0:
        # input logprobs are computed only for extended positions: keep those uncached
        keep = min(len(indices), req.logprob_start_len)
        if keep < len(indices):
            indices, cache_handle = tree_cache.match_prefix(req.cache_key(req.fill_ids[:keep]))
    req.prefix_indices = indices
    req.cache_handle = cache_handle
    req.extend_input_len = len(req.fill_ids) - len(indices)


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: "BasePrefixCache", seed: int = 0,
                 priority: "PriorityOrder | None" = None) -> None:
        self.policy = policy
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)
        self.priority = priority  # --enable-priority-scheduling: its order comes first

    def matches_all(self, queue_len: int) -> bool:
        """Does `order` match every request of a queue this long against the cache?"""
        return self.policy == "dfs-weight" or (self.policy == "lpm"
                                                and queue_len <= LPM_MAX_QUEUE_LEN)

    def _policy_for(self, queue_len: int) -> str:
        """The order a queue this long is taken in: lpm falls back to fcfs past its limit."""
        if self.policy == "lpm" and queue_len > LPM_MAX_QUEUE_LEN:
            return "fcfs"
        return self.policy

    def keeps_queue_order(self, queue_len: int) -> bool:
        """Does `order` return a queue this long as it stands (fcfs, or lpm's fallback)?"""
        return self._policy_for(queue_len) == "fcfs" and self.priority is None

    def order(self, waiting_queue: list[Req]) -> list[Req]:
        """Return the queue in admission order (by priority first, with priority
        scheduling). With `matches_all`, every request's prefix is matched; otherwise none is
        (the caller matches as it admits)."""
        ordered = self._policy_order(waiting_queue)
        return ordered if self.priority is None else self.priority.sort(ordered)

    def _policy_order(self, waiting_queue: list[Req]) -> list[Req]:
        policy = self._policy_for(len(waiting_queue))
        if self.matches_all(len(waiting_queue)):
            for req in waiting_queue:
                match_prefix(req, self.tree_cache)
        if policy == "lpm":
            return sorted(waiting_queue, key=lambda r: -len(r.prefix_indices))
        if policy == "random":
            queue = list(waiting_queue)
            self.rng.shuffle(queue)
            return queue
        if policy == "dfs-weight":
            return self._dfs_weight_order(waiting_queue)
        return list(waiting_queue)

    def _dfs_weight_order(self, waiting_queue: list[Req]) -> list[Req]:
        """Walk the tree depth-first, heaviest subtree first (weight = waiting requests under a
        node), so requests sharing a prefix run together."""
        root = getattr(self.tree_cache, "root", None)
        if root is None:  # no tree (radix cache disabled)
            return list(waiting_queue)
        reqs_at = defaultdict(list)
        for req in waiting_queue:
            reqs_at[id(req.cache_handle)].append(req)
        weight: dict[int, int] = {}

        def compute_weight(node) -> int:  # type: ignore[no-untyped-def]
            w = len(reqs_at.get(id(node), ()))
            for child in node.children.values():
                w += compute_weight(child)
            weight[id(node)] = w
            return w

        compute_weight(root)
        ordered: list[Req] = []
        stack = [root]
        while stack:
            node = stack.pop()
            ordered.extend(reqs_at.get(id(node), ()))
            children = sorted(node.children.values(), key=lambda c: weight[id(c)])
            stack.extend(c for c in children if weight[id(c)] > 0)
        if len(ordered) != len(waiting_queue):  # a node not in the tree (no cache): keep order
            seen = {id(r) for r in ordered}
            ordered.extend(r for r in waiting_queue if id(r) not in seen)
        return ordered
