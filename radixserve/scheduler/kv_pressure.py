"""The scheduler's answer to a KV pool running short for decode: evict cached prefixes, then
retract the cheapest running requests (retraction.py picks them) back to the queue.

A mixin of `Scheduler` (the pattern of SGLang's scheduler mixins): these methods read and
change the scheduler's queues, so they live on it; this file only keeps them together.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixserve.core.finish_reason import FinishReason
from radixserve.core.req import Req
from radixserve.scheduler.retraction import pick_retractions

if TYPE_CHECKING:
    from radixserve.mem.base_cache import BasePrefixCache
    from radixserve.mem.kv_pool import KVPool
    from radixserve.scheduler.overlap import InflightPrefill
    from radixserve.scheduler.retraction import NewTokenRatio
    from radixserve.scheduler.stats import SchedulerStats

logger = logging.getLogger("radixserve.scheduler")


class KVPressureMixin:
    running: list[Req]
    waiting_queue: list[Req]
    tree_cache: "BasePrefixCache"
    token_to_kv_pool: "KVPool"
    inflight_prefill: "InflightPrefill | None"
    chunked_req: Req | None
    ratio: "NewTokenRatio"
    stats: "SchedulerStats"

    if TYPE_CHECKING:
        def _settle(self) -> None: ...
        def _finish(self, req: Req, reason: FinishReason | None = None,
                    release: bool = True) -> None: ...

    def _decode_memory_available(self, need: int) -> bool:
        available = self.token_to_kv_pool.available_size()
        if available < need:
            self.tree_cache.evict(need - available)
        return self.token_to_kv_pool.available_size() >= need

    def _ensure_decode_memory(self, extra_tokens: int = 0) -> None:
        """Each running request needs one KV slot (plus `extra_tokens` for a prefill sharing the
        pass); retract the cheapest requests if short."""
        need = len(self.running) + extra_tokens
        if self.token_to_kv_pool.available_size() >= need:
            return
        self.tree_cache.evict(need - self.token_to_kv_pool.available_size())
        if self.token_to_kv_pool.available_size() >= need:
            return
        if self.inflight_prefill is not None:
            # its requests hold KV too: read it back so they can be retracted like the others
            self._settle()
            self._ensure_decode_memory(extra_tokens)
            return
        if not extra_tokens and self._set_chunked_req_aside():
            self._ensure_decode_memory()
            return
        order = getattr(self, "priority_order", None)
        keep, retract = pick_retractions(self.running, self._free_after_retraction, extra_tokens,
                                         order.rank if order is not None else None)
        self._retract(retract)
        self.running = keep
        self.ratio.after_retraction(keep)
        logger.warning("KV cache is full: retracted %d requests (%d still running); "
                       "new_token_ratio is now %.2f; %d retractions and %d recomputed tokens "
                       "so far", len(retract), len(keep), self.ratio.value,
                       self.stats.num_retractions, self.stats.num_recomputed_tokens)
        need = len(self.running) + extra_tokens
        self.tree_cache.evict(need - self.token_to_kv_pool.available_size())
        if self.running and self.token_to_kv_pool.available_size() < need:
            if extra_tokens:  # the chunk was promised its memory: the decodes step aside
                self._retract(self.running)
            else:  # one request alone fills the whole cache: it cannot grow, so it ends here
                for req in self.running:
                    self._finish(req, FinishReason.max_length(len(req.output_ids)))
            self.running = []

    def _set_chunked_req_aside(self) -> bool:
        """The prompt being chunked holds KV between its chunks but has no output yet: when
        the decodes are short it goes back to the front of the queue first (its chunks so far
        go to the prefix cache as evictable entries: what the decodes do not evict is reused
        when it returns; without the radix cache they are freed), as the newest request is
        preempted first in vLLM. Without this a running request alone in the pool was ended
        short beside it. Its prompt logprobs so far are dropped: its next prefill computes
        every position from logprob_start_len on again (the prefix match stops there)."""
        req = self.chunked_req
        if req is None or req.kv_len == 0:
            return False
        self.chunked_req, done = None, req.kv_len
        req.input_token_logprobs, req.input_top_logprobs = [], []
        self._retract([req])
        self.ratio.after_retraction(self.running)
        logger.warning("KV cache is full: the prompt being chunked (%d of %d tokens done) "
                       "steps aside for %d running requests", done,
                       len(req.origin_input_ids), len(self.running))
        return True

    def _ensure_prefill_memory(self, reqs: list[Req]) -> None:
        """A prefill batch (a prompt's next chunk, mostly) was admitted against memory that
        the decode turns run between chunks may have used since: where its new tokens no
        longer fit (free + evictable), the decodes step aside (retracted, resumed later with
        the same tokens) rather than the allocation failing."""
        need = sum(r.extend_input_len for r in reqs)
        if self.token_to_kv_pool.available_size() + self.tree_cache.evictable_size() >= need:
            return
        self._settle()
        self._ensure_decode_memory(extra_tokens=need)

    def _retract(self, reqs: list[Req]) -> None:
        """Back to the front of the queue with their output; their KV stays in the cache."""
        for req in reqs:
            self.tree_cache.cache_finished_req(req, token_ids=req.all_ids()[:req.kv_len])
            req.computed_before_retraction = max(req.computed_before_retraction, req.kv_len)
            req.kv_len = 0
            req.retraction_count += 1
            req.is_being_chunked = False
        self.waiting_queue = list(reqs) + self.waiting_queue
        self.stats.num_retractions += len(reqs)

    def _free_after_retraction(self, retracted: list[Req]) -> int:
        """Slots that would be free (or evictable) if `retracted` gave theirs back."""
        freed = sum(r.kv_len - len(r.prefix_indices) for r in retracted)
        return self.token_to_kv_pool.available_size() + self.tree_cache.evictable_size() + freed
