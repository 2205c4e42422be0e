"""The scheduler's KV accounting and reported state: tokens in use, the idle memory check
(free + cached == total, nothing locked, every request row free) and the InternalState that
/get_server_info and /metrics read."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.core.io_struct import InternalState
from radixserve.scheduler.stats import check_memory

if TYPE_CHECKING:
    from radixserve.core.req import Req
    from radixserve.scheduler.retraction import NewTokenRatio
    from radixserve.scheduler.stats import SchedulerStats


class AccountingMixin:
    max_total_num_tokens: int
    token_to_kv_pool: Any
    tree_cache: Any
    req_to_token_pool: Any
    waiting_queue: list["Req"]
    chunked_req: "Req | None"
    ratio: "NewTokenRatio"
    stats: "SchedulerStats"
    last_memory_check: tuple[bool, int] | None

    if TYPE_CHECKING:
        def admitted_reqs(self) -> list["Req"]: ...
        def _idle(self) -> bool: ...

    def tokens_in_use(self) -> int:
        """KV slots held by requests (a shared prefix counts once); the cache's evictable
        slots are not."""
        return self.max_total_num_tokens - self.token_to_kv_pool.available_size() \
            - self.tree_cache.evictable_size()

    def token_usage(self) -> float:
        return self.tokens_in_use() / self.max_total_num_tokens

    def check_memory(self) -> tuple[bool, int]:
        """When idle: free + cached == total, nothing locked, every request row free."""
        return check_memory(self.max_total_num_tokens, self.token_to_kv_pool, self.tree_cache,
                            self.req_to_token_pool)

    def _on_idle(self) -> None:
        self.ratio.reset()
        self.stats.on_idle()
        self.last_memory_check = self.check_memory()

    def get_internal_state(self, check_memory: bool = True) -> InternalState:
        """check_memory: when idle, also check the KV accounting (a walk of the tree)."""
        ok, leaked = self.check_memory() if check_memory and self._idle() else (None, 0)
        return self.stats.internal_state(
            num_running_reqs=len(self.admitted_reqs()) + (self.chunked_req is not None),
            num_queued_reqs=len(self.waiting_queue), max_total_num_tokens=self.max_total_num_tokens,
            available_tokens=self.token_to_kv_pool.available_size(),
            evictable_tokens=self.tree_cache.evictable_size(),
            protected_tokens=self.tree_cache.protected_size(), token_usage=self.token_usage(),
            new_token_ratio=self.ratio.value, memory_check_ok=ok, leaked_tokens=leaked)
