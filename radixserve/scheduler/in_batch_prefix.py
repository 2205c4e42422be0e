"""Deferring requests that share an uncached prefix with one already in the prefill batch.

Two requests admitted in the same prefill batch cannot share KV that is not cached yet: both would
compute it. When a waiting request shares a long uncached prefix with one just admitted, it is
better to leave it for the next turn, when that prefix is in the radix cache (SGLang does the same
for its cache-aware policies). Identical prompts (n > 1) are the common case.
"""
from __future__ import annotations

from radixserve.core.req import Req
from radixserve.mem.base_cache import BasePrefixCache

# defer when the shared uncached part is at least this long (or the whole uncached prompt)
MIN_SHARED_TOKENS = 32
_OWNERS = -1  # a trie node's key for the admitted requests through it (tokens are >= 0)


class InBatchPrefixIndex:
    """A token trie over the prompts admitted in this prefill batch."""

    def __init__(self, cache: BasePrefixCache, chunked: Req | None = None) -> None:
        """chunked: the request being chunked, whose next chunk's prompt is uncached too."""
        self.cache = cache
        self.root: dict[int, dict] = {}
        if chunked is not None:
            self.add(chunked)

    def add(self, req: Req) -> None:
        """Index an admitted request's prompt, as deep as a later query can need: a request
        that shares this one's tokens up to its own cached length c' shares them with the
        radix cache too, so this request matched at least c' and a query looks at most
        MIN_SHARED_TOKENS past that."""
        node = self.root
        for token in req.cache_key(req.fill_ids[:len(req.prefix_indices) + MIN_SHARED_TOKENS]):
            node = node.setdefault(token, {})
            node.setdefault(_OWNERS, []).append(req)

    def _walk(self, tokens: list[int]) -> tuple[dict, int]:
        node, length = self.root, 0
        for token in tokens:
            child = node.get(token)
            if child is None:
                break
            node, length = child, length + 1
        return node, length

    def should_defer(self, req: Req) -> bool:
        """True if `req` would recompute an uncached prefix another admitted request computes
        and the cache agrees it should wait (`BasePrefixCache.waits_behind`, given the
        admitted requests sharing most of the indexed prompts)."""
        cached = len(req.prefix_indices)
        uncached = len(req.fill_ids) - 1 - cached  # the last token is always recomputed
        if uncached <= 0 or not self.root:
            return False
        node, shared = self._walk(req.cache_key(req.fill_ids))
        if shared - cached < min(MIN_SHARED_TOKENS, uncached):
            return False
        return self.cache.waits_behind(req, node.get(_OWNERS, []))
