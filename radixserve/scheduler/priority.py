"""Priority scheduling (--enable-priority-scheduling, SGLang's flags): each request's `priority`
(higher values first, or lower first with --schedule-low-priority-values-first, as vLLM) orders
the waiting queue (the schedule policy's order within one priority), chooses retraction victims
(the least important first), and lets a waiting request that cannot be admitted preempt a
running one it outranks by at least --priority-scheduling-preemption-threshold: one running
request a blocked turn goes back to the queue (its KV cached, so it resumes cheaply), the
least important and, among equals, the one with the least output.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixserve.core.req import Req

logger = logging.getLogger(__name__)


class PriorityOrder:
    def __init__(self, low_values_first: bool, preemption_threshold: int) -> None:
        self.low_values_first = low_values_first
        self.threshold = preemption_threshold

    def rank(self, req: Req) -> int:
        """Smaller ranks are served first."""
        return req.priority if self.low_values_first else -req.priority

    def sort(self, reqs: list[Req]) -> list[Req]:
        """By rank; the given order within one rank (stable)."""
        return sorted(reqs, key=self.rank)


class PriorityMixin:
    running: list[Req]
    priority_order: PriorityOrder | None

    if TYPE_CHECKING:
        def _settle(self) -> None: ...
        def _retract(self, reqs: list[Req]) -> None: ...

    def _preempt_for_priority(self, queue: list[Req]) -> None:
        """A turn admitted nothing from `queue`: retract the running request its most
        important request outranks most, if by the threshold."""
        order = self.priority_order
        if order is None or not queue or not self.running:
            return
        top = min(order.rank(req) for req in queue)
        if not any(order.rank(r) - top >= order.threshold for r in self.running):
            return
        self._settle()  # the step in flight read back: `running` is what holds KV now
        victims = [r for r in self.running if order.rank(r) - top >= order.threshold]
        if not victims:
            return
        victim = max(victims, key=lambda r: (order.rank(r), -len(r.output_ids)))
        self.running = [r for r in self.running if r is not victim]
        self._retract([victim])
        logger.info("priority scheduling: request %s (priority %d, %d tokens out) preempted "
                    "for a waiting request of priority %d", victim.rid, victim.priority,
                    len(victim.output_ids), top if order.low_values_first else -top)
