"""--admission-plan cohorts: a burst of known-length requests admitted in whole cohorts, the
leftover first (scheduler/cohort_gate.py), with the fake runner's real pools."""
from __future__ import annotations

import random

from radixserve.scheduler.cohort_gate import CohortGate, full_cohort
from tests.scheduler.fake_runner import (assert_memory_clean, expected_output, make_req,
                                         make_scheduler)

PROMPT, MAX_NEW = 16, 17
# each request ends holding 16 + 17 tokens, plus the peak check's reserve of one: 8 fit at once
POOL = 8 * (PROMPT + MAX_NEW + 1)


def _burst(plan: str, count: int = 10, **params) -> tuple[object, dict, list[list[int]], list]:
    scheduler, _ = make_scheduler(max_total_tokens=POOL, admission_plan=plan,
                                  schedule_policy="fcfs")
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 50) for _ in range(PROMPT)] for _ in range(count)]
    for i, p in enumerate(prompts):
        scheduler.add_request(make_req(f"r{i}", p, max_new=MAX_NEW, **params))
    admissions = []  # (decode steps so far, requests admitted) per prefill batch
    results: dict = {}
    while scheduler.has_work():
        before = {r.rid for r in scheduler.admitted_reqs()}
        for out in scheduler.run_turn():
            for i, rid in enumerate(out.rids):
                results.setdefault(rid, []).extend(out.new_output_ids[i])
        joined = {r.rid for r in scheduler.admitted_reqs()} - before
        if joined:
            admissions.append((scheduler.stats.num_decode_steps, len(joined)))
    return scheduler, results, prompts, admissions


def test_the_leftover_goes_first_and_the_full_cohort_overlaps_it() -> None:
    """Greedy runs 8, then the 2 left over alone; cohorts run the 2 first and the 8 as soon as
    all of them fit beside the 2 until those finish: fewer decode steps, the same tokens."""
    greedy, greedy_out, prompts, greedy_admissions = _burst("greedy", ignore_eos=True)
    cohorts, cohort_out, _, cohort_admissions = _burst("cohorts", ignore_eos=True)
    assert [n for _, n in greedy_admissions] == [8, 2]
    assert cohort_admissions[0] == (0, 2) and [n for _, n in cohort_admissions[1:]] == [8]
    assert 0 < cohort_admissions[1][0] < MAX_NEW - 1  # before the first two finish
    assert cohorts.stats.num_decode_steps < greedy.stats.num_decode_steps
    for i, p in enumerate(prompts):
        assert greedy_out[f"r{i}"] == cohort_out[f"r{i}"] == expected_output(p, MAX_NEW)
    for scheduler in (greedy, cohorts):
        assert scheduler.stats.num_retractions == 0
        assert_memory_clean(scheduler)


def test_requests_that_may_stop_early_are_admitted_greedily() -> None:
    """Without ignore_eos the lengths are only bounds: the gate stays out of the way."""
    _, _, _, admissions = _burst("cohorts")
    _, _, _, greedy_admissions = _burst("greedy")
    assert admissions == greedy_admissions


def test_a_queue_that_fits_whole_opens_one_cohort() -> None:
    scheduler, results, prompts, admissions = _burst("cohorts", count=6, ignore_eos=True)
    assert admissions == [(0, 6)]
    assert all(results[f"r{i}"] == expected_output(p, MAX_NEW) for i, p in enumerate(prompts))
    assert_memory_clean(scheduler)


def test_gate_counts() -> None:
    scheduler, _ = make_scheduler(max_total_tokens=POOL)
    for i in range(20):
        scheduler.add_request(make_req(f"r{i}", [1] * PROMPT, max_new=MAX_NEW, ignore_eos=True))
    queue = scheduler.waiting_queue
    assert full_cohort(queue, POOL) == 8 and full_cohort(queue, POOL - 1) == 7
    assert full_cohort(queue, 3) == 1  # one request always makes a cohort
    gate = CohortGate()
    assert gate.allowance(queue, [], POOL, POOL) == 4  # 20 mod 8 first
    gate.admitted(3)
    assert gate.allowance(queue, [], POOL, POOL) == 1  # what is left of the open cohort
    gate.admitted(1)
    assert gate.allowance(queue[:16], [], POOL, POOL) == 8  # nothing left over: a full one


def test_cohorts_with_prompts_chunked_over_several_turns() -> None:
    """Prompts longer than a chunk: the request being chunked is not counted twice against
    the open cohort, every request finishes with its tokens and the pool is clean."""
    prompt, max_new, count = 40, 9, 7
    scheduler, _ = make_scheduler(max_total_tokens=4 * (prompt + max_new + 1),
                                  admission_plan="cohorts", schedule_policy="fcfs",
                                  chunked_prefill_size=16)
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 50) for _ in range(prompt)] for _ in range(count)]
    for i, p in enumerate(prompts):
        scheduler.add_request(make_req(f"r{i}", p, max_new=max_new, ignore_eos=True))
    most_running = 0
    results: dict = {}
    joins = []  # decode steps so far, for each request that left the queue
    while scheduler.has_work():
        queued = len(scheduler.waiting_queue)
        for out in scheduler.run_turn():
            for i, rid in enumerate(out.rids):
                results.setdefault(rid, []).extend(out.new_output_ids[i])
        joins += [scheduler.stats.num_decode_steps] * (queued - len(scheduler.waiting_queue))
        most_running = max(most_running, len(scheduler.admitted_reqs()))
    assert most_running <= 4
    # the leftover (7 mod 4) joins one chunked prompt at a time; the next 4 only much later
    assert len(joins) == count and joins[2] < 3 <= joins[3]
    for i, p in enumerate(prompts):
        assert results[f"r{i}"] == expected_output(p, max_new)
    assert scheduler.stats.num_retractions == 0
    assert_memory_clean(scheduler)
