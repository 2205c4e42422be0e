"""Counters the scheduler keeps for its log lines, /get_server_info and /metrics."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

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
    generated_since_log: int = 0
    last_log_time: float = field(default_factory=time.perf_counter)

    @property
    def cache_hit_rate(self) -> float:
        return self.total_cached_tokens / self.total_input_tokens if self.total_input_tokens else 0.0

    def log_prefill(self, num_reqs: int, new_tokens: int, cached_tokens: int, token_usage: float,
                    num_running: int, num_queued: int, chunked: bool) -> None:
        self.total_input_tokens += new_tokens + cached_tokens
        self.total_cached_tokens += cached_tokens
        logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
                    "cache hit rate: %.2f%%, token usage: %.2f, #running-req: %d, #queue-req: %d%s",
                    num_reqs, new_tokens, cached_tokens, 100 * self.cache_hit_rate, token_usage,
                    num_running, num_queued, ", chunked" if chunked else "")

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
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                    "cache hit rate: %.2f%%, gen throughput (token/s): %.2f, #queue-req: %d",
                    batch_size, num_tokens, token_usage, 100 * self.cache_hit_rate, throughput,
                    num_queued)


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
