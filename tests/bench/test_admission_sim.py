"""admission_sim.py: the step-cost fit, the peak check, and the steps each plan takes."""
from __future__ import annotations

import pytest

from benchmarks.admission_sim import (StepCost, Workload, fit_step_cost, greedy, hold,
                                      remainder_first, simulate)


def _log(cost: StepCost, points: list[tuple[int, int]]) -> list[str]:
    """Decode lines as the scheduler writes them, a prefill line after the first two (the
    line after it covers a prefill and must not be fitted)."""
    lines = []
    for i, (batch, tokens) in enumerate(points):
        rate = batch / cost.seconds(batch, tokens)
        if i == 2:
            lines.append("INFO radixserve.scheduler: Prefill batch. #new-seq: 12")
            rate /= 3  # an interval slowed by the prefill
        lines.append(f"INFO radixserve.scheduler: Decode batch. #running-req: {batch}, "
                     f"#token: {tokens}, token usage: 0.50, cache hit rate: 0.00%, "
                     f"gen throughput (token/s): {rate:.6f}, #queue-req: 0")
    return lines


def test_fit_recovers_the_step_cost_and_skips_intervals_with_a_prefill() -> None:
    cost = StepCost(3.2e-3, 22e-6, 18.1e-9)
    points = [(862, 900_000), (862, 1_300_000), (430, 600_000), (138, 200_000), (138, 280_000),
              (500, 700_000), (700, 1_100_000)]
    fitted = fit_step_cost(_log(cost, points))
    assert fitted.fixed == pytest.approx(cost.fixed, rel=1e-4)
    assert fitted.per_request == pytest.approx(cost.per_request, rel=1e-4)
    assert fitted.per_token == pytest.approx(cost.per_token, rel=1e-4)
    with pytest.raises(ValueError):
        fit_step_cost(_log(cost, points[:2]))


def _peak_usage(work: Workload, cohorts: list[tuple[int, int]]) -> int:
    last = max(start for start, _ in cohorts) + work.steps_per_request
    return max(sum(count * (work.input_len + step - start) for start, count in cohorts
                   if start <= step < start + work.steps_per_request) for step in range(last))


def test_plans_stay_within_the_pool_and_remainder_first_takes_fewer_steps() -> None:
    """10 requests of 16 in / 17 out (16 decode steps) in a pool that holds 8 at their peak:
    greedy runs 8, then 2 alone (32 steps); the remainder first starts the 2, and the 8 once
    they fit beside them until the 2 finish (step 7: 2 x 31 + 8 x 24 = 254 <= 256)."""
    work = Workload(requests=10, input_len=16, output_len=17, capacity=8 * 32)
    cost = StepCost(1.0, 0.0, 0.0)  # seconds = steps
    eager = simulate(work, greedy, cost)
    assert eager.cohorts == [(0, 8), (16, 2)] and eager.steps == 32
    assert eager.decode_seconds == 32
    planned = simulate(work, remainder_first, cost)
    assert planned.cohorts == [(0, 2), (7, 8)] and planned.steps == 23
    held = simulate(work, hold(2, 3), cost)  # held too briefly: the 8 do not fit until 7
    assert held.cohorts[0] == (0, 2) and sum(c for _, c in held.cohorts) == 10
    for outcome in (eager, planned, held):
        assert _peak_usage(work, outcome.cohorts) <= work.capacity
    # one step earlier the 8 would overflow the pool just before the 2 finish
    assert _peak_usage(work, [(0, 2), (6, 8)]) > work.capacity
