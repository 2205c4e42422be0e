"""Priority scheduling (--enable-priority-scheduling) with real pools and a fake model: the
queue is admitted by priority (the schedule policy's order within one), a waiting request
preempts a running one it outranks by the threshold (which resumes later with the same
tokens), retraction takes the least important first, and a request's priority is refused
unless the server schedules by it."""
from __future__ import annotations

from dataclasses import replace

import pytest

from radixserve.core.request_validation import InvalidRequestError, RequestLimits, \
    validate_request
from radixserve.core.sampling_params import SamplingParams
from radixserve.scheduler.retraction import pick_retractions
from tests.scheduler.fake_runner import (assert_memory_clean, expected_output, make_req,
                                         make_scheduler, run_all)


def _first_prefills(runner) -> list[int]:
    """The first prompt token of each request as its first prefill reached it, in pass
    order (a resumed request's prefill starts past its cached prefix: not counted)."""
    order = []
    for batch in runner.batches:
        if batch.forward_mode.is_decode():
            continue
        offset = 0
        for prefix, extend in zip(batch.extend_prefix_lens, batch.extend_seq_lens):
            if prefix == 0:
                order.append(batch.input_ids[offset])
            offset += extend
    return order


def _with_priority(rid: str, prompt: list[int], priority: int, max_new: int = 6):
    return replace(make_req(rid, prompt, max_new), priority=priority)


@pytest.mark.parametrize("low_first", [False, True])
def test_the_queue_is_admitted_by_priority(low_first: bool) -> None:
    scheduler, runner = make_scheduler(max_reqs=1, schedule_policy="fcfs",
                                       enable_priority_scheduling=True,
                                       schedule_low_priority_values_first=low_first,
                                       disable_overlap_schedule=True)
    priorities = {11: 1, 12: 5, 13: 3, 14: 5}
    for first, priority in priorities.items():
        assert scheduler.add_request(_with_priority(f"r{first}", [first, 2, 3], priority)) \
            is None
    results = run_all(scheduler)
    order = _first_prefills(runner)
    want = sorted(priorities, key=lambda f: priorities[f] if low_first else -priorities[f])
    assert order == want  # within priority 5, arrival order (fcfs)
    for first in priorities:
        assert results[f"r{first}"]["ids"] == expected_output([first, 2, 3], 6)
    assert_memory_clean(scheduler)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_waiting_request_preempts_one_it_outranks_by_the_threshold(overlap: bool) -> None:
    """One running slot: an urgent request (priority 20) arriving while a routine one (0)
    decodes takes its place; the routine one resumes afterwards and still produces exactly
    its tokens. A request outranking by less than the threshold (5 < 10) waits instead.
    Under the overlap schedule the step in flight is read back first."""
    scheduler, runner = make_scheduler(max_reqs=1, schedule_policy="fcfs",
                                       enable_priority_scheduling=True,
                                       disable_overlap_schedule=not overlap,
                                       num_continuous_decode_steps=1)
    scheduler.add_request(_with_priority("routine", [11, 2, 3], 0, max_new=30))
    for _ in range(3):
        scheduler.run_turn()
    scheduler.add_request(_with_priority("close", [12, 2, 3], 5))
    scheduler.run_turn()
    assert [r.rid for r in scheduler.running] == ["routine"]  # 5 does not preempt 0
    scheduler.add_request(_with_priority("urgent", [13, 2, 3], 20))
    results = run_all(scheduler)
    order = _first_prefills(runner)
    assert order[:2] == [11, 13] and order.index(13) < order.index(12)
    assert scheduler.stats.num_retractions >= 1
    for rid, first, n in (("routine", 11, 30), ("close", 12, 6), ("urgent", 13, 6)):
        assert results[rid]["ids"] == expected_output([first, 2, 3], n)
    assert_memory_clean(scheduler)


def test_retraction_takes_the_least_important_first() -> None:
    from radixserve.core.req import Req
    reqs = [Req(f"r{p}", [1, 2, 3], SamplingParams()) for p in (3, 0, 7)]
    for req, priority in zip(reqs, (3, 0, 7)):
        req.priority = priority
    keep, retract = pick_retractions(reqs, lambda gone: 10 * len(gone), rank=lambda r:
                                     -r.priority)
    assert [r.priority for r in retract][:1] == [0]
    keep, retract = pick_retractions(reqs, lambda gone: 0, rank=lambda r: -r.priority)
    assert [r.priority for r in retract] == [0, 3] and [r.priority for r in keep] == [7]


def test_a_priority_needs_priority_scheduling() -> None:
    limits = RequestLimits(context_len=64, vocab_size=50)
    with pytest.raises(InvalidRequestError, match="--enable-priority-scheduling"):
        validate_request([1, 2], SamplingParams(max_new_tokens=4), limits, priority=3)
    validate_request([1, 2], SamplingParams(max_new_tokens=4),
                     replace(limits, priority_scheduling=True), priority=3)
