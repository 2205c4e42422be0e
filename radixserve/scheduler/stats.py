"""Counters the scheduler keeps for its log lines, /get_server_info and /metrics."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.core.io_struct import InternalState

logger = logging.getLogger("radixserve.scheduler")

DECODE_LOG_INTERVAL = 40


@dataclass
class SchedulerStats:
    total_input_tokens: int = 0  # prompt tokens admitted (cached + extended)
    total_cached_tokens: int = 0
    num_retractions: int = 0
    # tokens prefilled again for requests that had been retracted (their KV not in the cache)
    num_recomputed_tokens: int = 0
    num_decode_steps: int = 0
    # speculative decoding: requests that verified drafts (a request per step), drafts
    # proposed, drafts accepted, since the start, and requests / tokens since the last decode
    # log line
    spec_verified_reqs: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_reqs_since_log: int = 0
    spec_accepted_since_log: int = 0
    generated_since_log: int = 0
    last_log_time: float = field(default_factory=time.perf_counter)

    @property
    def cache_hit_rate(self) -> float:
        return self.total_cached_tokens / self.total_input_tokens if self.total_input_tokens else 0.0

    def log_prefill(self, num_reqs: int, new_tokens: int, cached_tokens: int, token_usage: float,
                    num_running: int, num_queued: int, chunked: bool,
                    num_images: int = 0) -> None:
        """`num_images`: the images whose placeholders the batch's new tokens cover."""
        self.total_input_tokens += new_tokens + cached_tokens
        self.total_cached_tokens += cached_tokens
        logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
                    "cache hit rate: %.2f%%, token usage: %.2f, #running-req: %d, #queue-req: "
                    "%d%s%s", num_reqs, new_tokens, cached_tokens, 100 * self.cache_hit_rate,
                    token_usage, num_running, num_queued,
                    f", #image: {num_images}" if num_images else "",
                    ", chunked" if chunked else "")

    def on_verify_step(self, num_reqs: int, proposed: int, accepted: int) -> None:
        """A speculative step (`num_reqs`: those with drafts): before on_decode_step, which
        counts one token per request."""
        self.spec_verified_reqs += num_reqs
        self.spec_proposed_tokens += proposed
        self.spec_accepted_tokens += accepted
        self.spec_reqs_since_log += num_reqs
        self.spec_accepted_since_log += accepted
        self.generated_since_log += accepted

    def after_flush(self) -> "SchedulerStats":
        """The counters a cache flush keeps (the cache's hit counts start over)."""
        return SchedulerStats(
            num_retractions=self.num_retractions, num_recomputed_tokens=self.num_recomputed_tokens,
            num_decode_steps=self.num_decode_steps, spec_verified_reqs=self.spec_verified_reqs,
            spec_proposed_tokens=self.spec_proposed_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens)

    def internal_state(self, **scheduler_state: Any) -> InternalState:
        """/get_server_info's and /metrics' state: the scheduler's queues and pool, and these
        counters."""
        return InternalState(
            cache_hit_rate=self.cache_hit_rate, num_retractions=self.num_retractions,
            num_recomputed_tokens=self.num_recomputed_tokens,
            num_decode_steps=self.num_decode_steps, spec_verified_reqs=self.spec_verified_reqs,
            spec_proposed_tokens=self.spec_proposed_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens, **scheduler_state)

    def on_idle(self) -> None:
        """Nothing runs: the next decode log's throughput counts from when work resumes."""
        self.generated_since_log = 0
        self.last_log_time = time.perf_counter()

    def on_decode_step(self, batch_size: int, num_tokens: int, token_usage: float,
                       num_queued: int) -> None:
        self.num_decode_steps += 1
        self.generated_since_log += batch_size
        if self.num_decode_steps % DECODE_LOG_INTERVAL:
            return
        now = time.perf_counter()
        throughput = self.generated_since_log / max(now - self.last_log_time, 1e-9)
        self.generated_since_log = 0
        self.last_log_time = now
        spec = ""
        if self.spec_reqs_since_log:
            spec = ", accept len: %.2f" % (1 + self.spec_accepted_since_log
                                           / self.spec_reqs_since_log)
            self.spec_reqs_since_log = self.spec_accepted_since_log = 0
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                    "cache hit rate: %.2f%%, gen throughput (token/s): %.2f, #queue-req: %d%s",
                    batch_size, num_tokens, token_usage, 100 * self.cache_hit_rate, throughput,
                    num_queued, spec)


def check_memory(max_total_num_tokens: int, token_to_kv_pool: Any, tree_cache: Any,
                 req_to_token_pool: Any) -> tuple[bool, int]:
    """(ok, leaked tokens): free + cached == total, nothing locked, every request row free."""
    free = token_to_kv_pool.available_size()
    cached = tree_cache.total_size()
    leaked = max_total_num_tokens - free - cached
    ok = (leaked == 0 and tree_cache.protected_size() == 0
          and req_to_token_pool.available_size() == req_to_token_pool.size)
    if not ok:
        logger.error("memory check failed: total %d, free %d, cached %d, protected %d, "
                     "free request rows %d/%d", max_total_num_tokens, free, cached,
                     tree_cache.protected_size(), req_to_token_pool.available_size(),
                     req_to_token_pool.size)
    return ok, leaked
