"""`--admission-plan cohorts`: admit a burst of known-length requests in whole cohorts, the
leftover first, so that the run's cohorts overlap instead of running one after another.

Why: requests that always run to their length (ignore_eos, as offline benchmarks send them)
and were queued together grow together. Greedy admission fills the pool for the moment the
whole first cohort peaks, and the requests left over wait until that cohort finishes and then
run alone: 1,000 x 1024/1024 with room for 850 at their peak decodes 850 for 1,023 steps and
then 150 for 1,023 more. Each step reads the weights once whatever its batch, so the second
cohort's steps are the expensive ones. Admitting the leftover first (150), and the full cohort
(850) as soon as all of it fits beside them until they finish, starts the full cohort ~360
steps in: 1,382 decode steps instead of 2,046 (benchmarks/admission_sim.py, which also prices
the steps with a cost fitted to a run's log).

The rule, at each prefill turn, for a queue and running set of known-length requests only
(otherwise no limit: greedy admission, as without the flag):
- a cohort is open: admit up to what is left of it;
- nothing runs: open a cohort of the leftover (queue mod full cohort), or a full one when
  nothing is left over or the queue fits whole;
- else open a full cohort (or the whole queue, if smaller) only when all of it passes the peak
  check at once beside the running requests; until then admit nothing.
A full cohort is how many of the queue's first requests fit in the whole pool at once, each
counted at its prompt plus its output (what it holds when it finishes).

Opt-in: it trades the first requests' latency for the run's length, and only pays when a
burst of requests of known length outgrows the pool.
"""
from __future__ import annotations

from dataclasses import dataclass

from radixserve.core.req import Req
from radixserve.scheduler.admission import (PEAK_RESERVE_PER_REQUEST, PeakCheck,
                                            expected_new_tokens, has_known_length)


def _final_tokens(req: Req) -> int:
    """What the request holds when it finishes: its prompt, its output so far, the rest."""
    return req.seqlen + expected_new_tokens(req)


def full_cohort(queue: list[Req], pool_tokens: int) -> int:
    """How many of the queue's first requests the pool holds at once at their final size
    (at least one)."""
    total, count = 0, 0
    for req in queue:
        total += _final_tokens(req) + PEAK_RESERVE_PER_REQUEST
        if total > pool_tokens:
            break
        count += 1
    return max(count, 1)


def cohort_fits(cohort: list[Req], running: list[Req], free_tokens: float) -> bool:
    """Do these queued requests pass the peak check all together beside the running ones?
    free_tokens: free now (free + evictable, as admission counts it)."""
    pairs = sorted((expected_new_tokens(r), r.seqlen) for r in running + cohort)
    peak = PeakCheck([left for left, _ in pairs], [held for _, held in pairs])
    return peak.holds(free_tokens - sum(r.seqlen for r in cohort))


@dataclass
class CohortGate:
    open_left: int = 0  # requests the open cohort may still admit

    def allowance(self, queue: list[Req], running: list[Req], free_tokens: float,
                  pool_tokens: int) -> int | None:
        """How many queued requests this turn may admit; None: no limit (greedy)."""
        if not queue or not all(has_known_length(r) for r in queue) \
                or not all(has_known_length(r) for r in running):
            self.open_left = 0
            return None
        if self.open_left > 0:
            return self.open_left
        whole = full_cohort(queue, pool_tokens)
        if not running:
            leftover = len(queue) % whole
            self.open_left = leftover if len(queue) > whole and leftover else \
                min(len(queue), whole)
            return self.open_left
        want = min(len(queue), whole)
        if cohort_fits(queue[:want], running, free_tokens):
            self.open_left = want
        return self.open_left

    def admitted(self, count: int) -> None:
        self.open_left = max(0, self.open_left - count)
