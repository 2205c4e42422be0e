"""Admission of requests of known length (ignore_eos): the exact peak check, against v0.2's
ratio estimate that over-admits them and then retracts."""
from __future__ import annotations

import bisect
import random

from radixserve.scheduler.admission import PEAK_RESERVE_PER_REQUEST, PeakCheck
from tests.scheduler.fake_runner import (assert_memory_clean, expected_output, make_req,
                                         make_scheduler, run_all)


def test_peak_check_counts_what_finished_requests_hand_back() -> None:
    peak = PeakCheck()
    peak.add(100, 10)  # running: 10 tokens held, 100 still to generate
    # a 50-token prompt generating 20: 90 free after its prompt. When it finishes (t = 20)
    # both have grown by 20 (90 - 40 = 50 free); it hands back 50 + 20, and when the first one
    # finishes (t = 100) 90 + 50 - 100 = 40 are free. A flat reservation (100 + 20 > 90) refuses.
    assert peak.fits(90, 20, 50)
    # the same request generating 80: at t = 80, 90 - 160 < 0
    assert not peak.fits(90, 80, 50)
    # reserve: one free token per request still running at each moment
    alone = PeakCheck()
    alone.add(20, 5)
    assert alone.fits(2 * 20 + 2, 20, 0) and not alone.fits(2 * 20 + 1, 20, 0)
    peak.add(20, 50)
    assert peak.left == [20, 100] and peak.held == [50, 10]


def _fits_by_walking_every_moment(left: list[int], held: list[int], free: float,
                                  tokens_left: int, tokens_held: int) -> bool:
    """The definition: insert the request, then walk the finishing moments in order."""
    at = bisect.bisect_right(left, tokens_left)
    left = left[:at] + [tokens_left] + left[at:]
    held = held[:at] + [tokens_held] + held[at:]
    freed, still_running = 0, len(left)
    for tokens, occupied in zip(left, held):
        if free + freed - tokens * still_running < PEAK_RESERVE_PER_REQUEST * still_running:
            return False
        freed += occupied
        still_running -= 1
    return True


def test_peak_check_tables_agree_with_walking_every_moment() -> None:
    rng = random.Random(4)
    for trial in range(300):
        peak = PeakCheck()
        for _ in range(rng.randrange(0, 40)):
            peak.add(rng.randrange(1, 200), rng.randrange(1, 300))
        for _ in range(10):
            tokens_left, tokens_held = rng.randrange(1, 250), rng.randrange(1, 300)
            expected_free = sum(peak.left) // max(1, len(peak.left)) * (len(peak.left) + 1)
            free = rng.choice([rng.uniform(0, 2 * expected_free + 100),
                               float(rng.randrange(0, 20_000))])
            assert peak.fits(free, tokens_left, tokens_held) == _fits_by_walking_every_moment(
                peak.left, peak.held, free, tokens_left, tokens_held), trial
        if rng.random() < 0.5:  # the tables follow later additions
            peak.add(rng.randrange(1, 200), rng.randrange(1, 300))
            assert peak.fits(1e9, 5, 5) and not peak.fits(0, 5, 5)


def _run_counting_peak(scheduler) -> tuple[dict[str, dict], int]:
    results: dict[str, dict] = {}
    most_running = 0
    while scheduler.has_work():
        for out in scheduler.run_turn():
            for i, rid in enumerate(out.rids):
                results.setdefault(rid, {"ids": []})["ids"] += out.new_output_ids[i]
        most_running = max(most_running, len(scheduler.running))
    return results, most_running


def test_known_length_requests_fill_the_pool_without_retraction() -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 50) for _ in range(20)] for _ in range(8)]
    # v0.2's estimate with a low ratio over-admits requests that run to their length ...
    scheduler, _ = make_scheduler(max_total_tokens=260, schedule_conservativeness=0.05)
    for i, p in enumerate(prompts):
        scheduler.add_request(make_req(f"r{i}", p, max_new=40))
    run_all(scheduler)
    assert scheduler.stats.num_retractions > 0
    # ... which the peak check does not: 4 x (20 + 40 + 1) fits 260 tokens, 5 would not
    scheduler, _ = make_scheduler(max_total_tokens=260, schedule_conservativeness=0.05)
    for i, p in enumerate(prompts):
        scheduler.add_request(make_req(f"r{i}", p, max_new=40, ignore_eos=True))
    results, most_running = _run_counting_peak(scheduler)
    assert scheduler.stats.num_retractions == 0
    assert most_running == 4
    for i, p in enumerate(prompts):
        assert results[f"r{i}"]["ids"] == expected_output(p, 40)
    assert_memory_clean(scheduler)


def test_staggered_known_lengths_overlap_where_a_flat_reservation_would_not() -> None:
    """A long request is running; short ones join because they finish (and hand their memory
    back) long before it needs its last tokens."""
    scheduler, _ = make_scheduler(max_total_tokens=200, num_continuous_decode_steps=1)
    scheduler.add_request(make_req("long", [1] * 10, max_new=150, ignore_eos=True))
    scheduler.run_turn()
    scheduler.add_request(make_req("short", [2] * 40, max_new=10, ignore_eos=True))
    scheduler.run_turn()
    # a flat reservation: 11 held + 149 to come + 40 + 10 > 200; the peak (t = 10) is ~71
    assert sorted(r.rid for r in scheduler.admitted_reqs()) == ["long", "short"]
    results = run_all(scheduler)
    assert results["short"]["ids"] == expected_output([2] * 40, 10)
    assert results["long"]["ids"] == expected_output([1] * 10, 150)
    assert scheduler.stats.num_retractions == 0
    assert_memory_clean(scheduler)


def test_a_request_as_long_as_the_kv_cache_runs_and_a_longer_one_is_cut() -> None:
    """The KV cache (64 tokens) is shorter than the context (256). A request of exactly
    RequestLimits.max_sequence_tokens (63) runs alone, known length or not; a longer one that
    bypassed the front ends' check is cut to it (it could never be admitted: it used to wait
    forever and hold up every request queued behind it)."""
    prompt = [3] * 20
    for params in ({"ignore_eos": True}, {}):
        scheduler, _ = make_scheduler(max_total_tokens=64, context_len=256)
        assert scheduler.limits.max_sequence_tokens == 63
        scheduler.add_request(make_req("whole", prompt, max_new=43, **params))
        scheduler.add_request(make_req("too-long", prompt, max_new=200, min_new_tokens=100,
                                       **params))
        scheduler.add_request(make_req("after", [4] * 5, max_new=5, **params))
        results = run_all(scheduler)
        assert results["whole"]["ids"] == expected_output(prompt, 43)
        assert results["too-long"]["ids"] == expected_output(prompt, 43)
        assert results["too-long"]["finish"]["type"] == "length"
        assert results["after"]["ids"] == expected_output([4] * 5, 5)
        assert_memory_clean(scheduler)


def test_front_ends_refuse_a_request_longer_than_the_kv_cache() -> None:
    from radixserve.core.request_validation import RequestLimits, validate_request
    from radixserve.core.sampling_params import InvalidRequestError, SamplingParams

    limits = RequestLimits(context_len=256, vocab_size=100, max_total_tokens=64)
    validate_request([1] * 20, SamplingParams(max_new_tokens=43), limits)
    try:
        validate_request([1] * 20, SamplingParams(max_new_tokens=44), limits)
    except InvalidRequestError as exc:
        assert "KV cache holds 64 tokens" in str(exc) and "at most 43" in str(exc)
        assert exc.param == "max_tokens"
    else:
        raise AssertionError("a request longer than the KV cache was accepted")
    # a prompt must leave room for one output token: 62 of the 63 a request reaches
    validate_request([1] * 62, SamplingParams(max_new_tokens=1), limits)
    for prompt_len in (63, 64, 65):  # 63 was let through with "at most 0 to generate"
        try:
            validate_request([1] * prompt_len, SamplingParams(max_new_tokens=1), limits)
        except InvalidRequestError as exc:
            assert exc.param == "prompt" and "at most 62 prompt tokens" in str(exc), str(exc)
            assert "KV cache: it holds 64 tokens" in str(exc)
        else:
            raise AssertionError(f"a {prompt_len}-token prompt was accepted")
    # without a KV cache bound (or a larger one) the context length is the bound
    assert RequestLimits(context_len=256, vocab_size=100).max_sequence_tokens == 256
