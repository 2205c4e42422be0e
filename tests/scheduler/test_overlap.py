"""Decode with overlap: step k+1 is launched before step k's ids are read.

The fake runner checks, on every pass, that each request's KV slots hold exactly its tokens, and
that the input ids it is handed (from the previous step, on the "device") are the right ones; so
a row mix-up in the overlap path fails here even when the final text would look plausible."""
from __future__ import annotations

import random

import pytest

from radixserve.core.io_struct import TokenizedGenerateReq
from radixserve.core.sampling_params import SamplingParams
from tests.scheduler.fake_runner import (assert_memory_clean, expected_output, make_req,
                                         make_scheduler, run_all)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.mark.parametrize("steps", [1, 3, 10])
def test_outputs_same_with_and_without_overlap(steps: int) -> None:
    """Ragged max_new_tokens: requests leave the batch at different steps, so later steps
    pick their input ids out of the previous step's rows."""
    results = []
    for overlap in (True, False):
        scheduler, runner = make_scheduler(num_continuous_decode_steps=steps,
                                           disable_overlap_schedule=not overlap)
        ps = prompts(10, seed=steps)
        for i, p in enumerate(ps):
            scheduler.add_request(make_req(f"r{i}", p, max_new=1 + (7 * i) % 23))
        results.append(run_all(scheduler))
        assert (runner.async_steps > 0) == overlap
        assert_memory_clean(scheduler)
    assert results[0] == results[1]
    for i, p in enumerate(prompts(10, seed=steps)):
        assert results[0][f"r{i}"]["ids"] == expected_output(p, 1 + (7 * i) % 23)


def test_stop_token_found_one_step_late_is_cut_and_frees_its_slots() -> None:
    """A stop token is only seen after the next step was launched: the extra token is dropped
    and the slot that step wrote is released with the request."""
    scheduler, runner = make_scheduler(num_continuous_decode_steps=10)
    prompt = [3, 1, 4]
    expected = expected_output(prompt, 30)
    k = next(i for i in range(3, 30) if expected[i] not in expected[:i])
    scheduler.add_request(make_req("stop", prompt, max_new=30, stop_token_ids=[expected[k]]))
    scheduler.add_request(make_req("long", [9, 9], max_new=30))
    results = run_all(scheduler)
    assert results["stop"]["ids"] == expected[:k + 1]
    assert results["stop"]["finish"] == {"type": "stop", "matched": expected[k]}
    assert results["long"]["ids"] == expected_output([9, 9], 30)
    assert runner.async_steps > 0
    assert_memory_clean(scheduler)


def test_length_limits_are_not_overrun() -> None:
    """Requests that end by length are left out of the step after their last: no request is
    ever decoded past max_new_tokens or the context length."""
    scheduler, runner = make_scheduler(num_continuous_decode_steps=8, context_len=40)
    scheduler.add_request(make_req("ctx", [5] * 30, max_new=100))
    scheduler.add_request(make_req("len", [6] * 4, max_new=5))
    results = run_all(scheduler)
    assert len(results["ctx"]["ids"]) == 10 and results["len"]["ids"] == expected_output([6] * 4, 5)
    longest = max(max(b.seq_lens) for b in runner.batches)
    assert longest <= 40
    assert_memory_clean(scheduler)


def sampled_req(rid: str, prompt: list[int], **params) -> TokenizedGenerateReq:
    sp = SamplingParams(max_new_tokens=6, temperature=0.8, **params)
    sp.verify()
    sp.normalize()
    return TokenizedGenerateReq(rid=rid, input_text=None, input_ids=prompt, sampling_params=sp)


@pytest.mark.parametrize("params,return_logprob,overlaps", [
    ({}, False, True),                           # plain sampling
    ({"seed": 7}, False, True),                  # seed steps carried and advanced on the device
    ({"frequency_penalty": 0.5}, False, True),   # penalty counts likewise
    ({"min_new_tokens": 6}, False, True),        # and the min_new_tokens mask
    ({}, True, True),                            # logprobs: copied back with the ids
])
def test_which_sampling_overlaps(params: dict, return_logprob: bool, overlaps: bool) -> None:
    scheduler, runner = make_scheduler(num_continuous_decode_steps=4)
    req = sampled_req("s", [1, 2, 3], **params)
    req.return_logprob = return_logprob
    scheduler.add_request(req)
    results = run_all(scheduler)
    assert results["s"]["ids"] == expected_output([1, 2, 3], 6)  # the fake ignores sampling
    assert (runner.async_steps > 0) == overlaps
    assert_memory_clean(scheduler)


def test_steps_stay_in_flight_across_turns() -> None:
    """A turn launches its steps and returns with the last one still running; the next turn
    continues from it on the device. Non-streaming: all five steps launched, four read back."""
    scheduler, runner = make_scheduler(num_continuous_decode_steps=5)
    scheduler.add_request(make_req("a", [1, 2, 3], max_new=50))
    scheduler.run_turn()  # prefill
    before = len(runner.batches)
    assert scheduler.run_turn() == []
    assert len(runner.batches) - before == 5 and scheduler.inflight is not None
    assert len(scheduler.running[0].output_ids) == 1 + 4
    assert scheduler.has_work()
    results = run_all(scheduler)
    assert results["a"]["ids"] == expected_output([1, 2, 3], 50)
    assert scheduler.inflight is None
    assert_memory_clean(scheduler)


def test_streaming_sends_each_token_while_the_next_step_runs() -> None:
    scheduler, runner = make_scheduler(num_continuous_decode_steps=5)
    scheduler.add_request(make_req("s", [4, 5, 6], max_new=6, stream=True))
    assert scheduler.run_turn() == []  # the prefill is launched, its token not yet read
    assert scheduler.inflight_prefill is not None and runner.async_prefills == 1
    before = len(runner.batches)
    first = scheduler.run_turn()  # read the prefill's token, launch step 1, send
    assert len(runner.batches) - before == 1 and scheduler.inflight is not None
    assert first[0].new_output_ids[0] == expected_output([4, 5, 6], 1)
    for k in range(2, 6):  # from then on: one launched, one read back and sent, per turn
        before = len(runner.batches)
        outs = scheduler.run_turn()
        assert outs[0].new_output_ids[0] == expected_output([4, 5, 6], k)[k - 1:]
        assert len(runner.batches) - before == 1  # at k = 5: the step of token 6, the last
    before = len(runner.batches)
    outs = scheduler.run_turn()  # nothing left to launch: read token 6 back, finish
    assert len(runner.batches) == before and outs[0].new_output_ids[0] == \
        expected_output([4, 5, 6], 6)[5:]
    assert outs[0].finished_reasons[0] == {"type": "length", "length": 6}
    assert not scheduler.has_work()
    assert_memory_clean(scheduler)


def test_abort_while_a_step_is_in_flight() -> None:
    scheduler, _ = make_scheduler(num_continuous_decode_steps=3)
    scheduler.add_request(make_req("x", [7, 8], max_new=40))
    scheduler.add_request(make_req("y", [9, 9, 9], max_new=20))
    scheduler.run_turn()  # prefill both
    scheduler.run_turn()  # decode, a step left in flight
    assert scheduler.inflight is not None
    scheduler.abort_request("x")
    assert scheduler.inflight is None  # settled before the abort touched x's memory
    results = run_all(scheduler)
    assert results["y"]["ids"] == expected_output([9, 9, 9], 20)
    assert_memory_clean(scheduler)


def test_retraction_under_overlap_keeps_outputs_exact() -> None:
    """A pool too small for every request: decode runs short of KV mid-turn, stops launching,
    and the next turn retracts; outputs still match the model's."""
    scheduler, runner = make_scheduler(max_total_tokens=160, num_continuous_decode_steps=10)
    ps = prompts(6, seed=3)
    for i, p in enumerate(ps):
        scheduler.add_request(make_req(f"r{i}", p[:15], max_new=40))
    results = run_all(scheduler)
    for i, p in enumerate(ps):
        assert results[f"r{i}"]["ids"] == expected_output(p[:15], 40)
    assert scheduler.stats.num_retractions > 0 and runner.async_steps > 0
    assert_memory_clean(scheduler)


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_requests_joining_a_decode_batch_in_flight_get_exact_outputs(policy: str) -> None:
    """Prefill batches launched ahead (read back once the next pass is launched) while other
    requests decode: requests arrive over many turns, share prefixes, are chunked, stop on
    tokens or by length, and join the carried decode batch; every output is the model's, as
    with the synchronous schedule, and no slot leaks."""
    rng = random.Random(7)
    base = [rng.randrange(1, 50) for _ in range(30)]
    arrivals = []
    for i in range(24):
        prompt = base[:rng.randrange(0, 30)] + [rng.randrange(1, 50)
                                                for _ in range(rng.randrange(1, 25))]
        max_new = rng.randrange(1, 30)
        expected = expected_output(prompt, max_new)
        stop = [expected[-1]] if i % 3 == 0 and expected[-1] not in expected[:-1] else None
        arrivals.append((rng.randrange(0, 60), f"r{i}", prompt, max_new, stop))
    results = []
    for overlap in (True, False):
        scheduler, runner = make_scheduler(
            max_total_tokens=600, num_continuous_decode_steps=3, schedule_policy=policy,
            chunked_prefill_size=16, disable_overlap_schedule=not overlap)
        outputs: dict[str, list[int]] = {}
        for turn in range(2000):
            for when, rid, prompt, max_new, stop in arrivals:
                if when == turn:
                    scheduler.add_request(make_req(rid, prompt, max_new=max_new,
                                                   stop_token_ids=stop))
            for out in scheduler.run_turn():
                for i, rid in enumerate(out.rids):
                    outputs.setdefault(rid, []).extend(out.new_output_ids[i])
            if turn > 60 and not scheduler.has_work():
                break
        assert not scheduler.has_work()
        assert_memory_clean(scheduler)
        results.append(outputs)
        if overlap:
            assert runner.async_prefills > 0 and runner.joined_steps > 0
        else:
            assert runner.async_prefills == 0 and runner.async_steps == 0
    assert results[0] == results[1]
    for _, rid, prompt, max_new, stop in arrivals:
        expected = expected_output(prompt, max_new)
        assert results[0][rid] == expected


def test_chunks_of_a_long_prompt_launch_before_the_one_before_is_read() -> None:
    scheduler, runner = make_scheduler(chunked_prefill_size=16)
    prompt = [(7 * i) % 49 + 1 for i in range(70)]
    scheduler.add_request(make_req("long", prompt, max_new=5))
    for chunk in range(1, 5):  # 16, 32, 48, 64 tokens: each launched while the last runs
        assert scheduler.run_turn() == []
        assert runner.async_prefills == chunk and scheduler.inflight_prefill is not None
        assert scheduler.chunked_req is not None
    results = run_all(scheduler)
    assert results["long"]["ids"] == expected_output(prompt, 5)
    assert runner.async_prefills == 5
    assert_memory_clean(scheduler)


def test_abort_and_state_while_a_prefill_is_in_flight() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(make_req("keep", [1, 2, 3], max_new=12))
    scheduler.add_request(make_req("drop", [4, 5, 6, 7], max_new=12))
    assert scheduler.run_turn() == []
    state = scheduler.get_internal_state()
    assert state.num_running_reqs == 2 and state.memory_check_ok is None  # not idle
    assert scheduler.inflight_prefill is not None
    scheduler.abort_request("drop")
    assert scheduler.inflight_prefill is None  # read back before the abort freed its memory
    results = run_all(scheduler)
    assert results["drop"]["finish"]["type"] == "abort"
    assert results["keep"]["ids"] == expected_output([1, 2, 3], 12)
    assert_memory_clean(scheduler)


@pytest.mark.parametrize("logprob_start_len,ahead", [(0, False), (-1, True)])
def test_only_prompt_logprobs_keep_a_prefill_synchronous(logprob_start_len: int,
                                                        ahead: bool) -> None:
    """Prompt logprobs are assembled on the host: such a batch is read back at once. The
    sampled token's logprobs come back with the ids, so a batch asking only for those is
    launched ahead like any other."""
    scheduler, runner = make_scheduler()
    req = make_req("lp", [1, 2, 3], max_new=4, stream=True)
    req.return_logprob = True
    req.logprob_start_len = logprob_start_len
    scheduler.add_request(req)
    first = scheduler.run_turn()
    assert runner.async_prefills == int(ahead)
    assert (first == []) == ahead
    results = run_all(scheduler)
    assert_memory_clean(scheduler)
    assert len(results["lp"]["ids"]) == 4 - (0 if ahead else 1)


def test_the_decode_step_between_two_chunks_leaves_the_prefill_in_flight() -> None:
    """Chunk, one decode step, chunk: the decode step is launched behind the chunk's pass and
    neither is read back in that turn; the next turn launches the next chunk first."""
    scheduler, runner = make_scheduler(chunked_prefill_size=16,
                                       num_continuous_decode_steps=4)
    scheduler.add_request(make_req("run", [3, 4], max_new=30))
    first_turns = [scheduler.run_turn() for _ in range(3)]  # prefill, read back, decode
    assert first_turns[0] == []
    prompt = [(5 * i) % 47 + 1 for i in range(60)]
    scheduler.add_request(make_req("long", prompt, max_new=6))
    scheduler.run_turn()  # the first chunk, launched ahead
    assert scheduler.inflight_prefill is not None and scheduler.chunked_req is not None
    scheduler.run_turn()  # the decode turn between chunks
    assert scheduler.inflight is not None and scheduler.inflight_prefill is not None
    prefills = runner.async_prefills
    scheduler.run_turn()  # the next chunk is launched before both are read back
    assert runner.async_prefills == prefills + 1
    assert scheduler.inflight is None and scheduler.inflight_prefill is not None
    results = run_all(scheduler)
    assert results["long"]["ids"] == expected_output(prompt, 6)
    assert results["run"]["ids"] == expected_output([3, 4], 30)
    assert_memory_clean(scheduler)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_small_pool_with_prefills_in_flight_keeps_outputs_exact(seed: int) -> None:
    """KV so short that decode retracts while prefills are launched ahead: every request
    still gets exactly the model's tokens (none cut short by a prefill's memory in flight)."""
    rng = random.Random(seed)
    reqs = [(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(5, 40))],
             rng.randrange(5, 40)) for i in range(14)]
    for overlap in (True, False):
        scheduler, _ = make_scheduler(max_total_tokens=150, num_continuous_decode_steps=4,
                                      chunked_prefill_size=16, schedule_conservativeness=0.3,
                                      disable_overlap_schedule=not overlap)
        for rid, prompt, max_new in reqs:
            scheduler.add_request(make_req(rid, prompt, max_new=max_new))
        results = run_all(scheduler)
        for rid, prompt, max_new in reqs:
            assert results[rid]["ids"] == expected_output(prompt, max_new), (overlap, rid)
        assert scheduler.stats.num_retractions > 0
        assert_memory_clean(scheduler)


def test_short_of_kv_with_a_prefill_in_flight_retracts_instead_of_cutting() -> None:
    """The KV pool runs dry while a prefill is in flight: the decode step reads the prefill
    back first, so its request can be retracted (its KV goes back to the cache) and the one
    running goes on; without that, the running request alone would look too big for the pool
    and be ended early."""
    scheduler, _ = make_scheduler(max_total_tokens=200, num_continuous_decode_steps=1)
    scheduler.add_request(make_req("a", [1, 2, 3, 4, 5], max_new=40))
    for _ in range(4):
        scheduler.run_turn()
    scheduler.add_request(make_req("b", [6] * 20, max_new=10))
    scheduler.run_turn()  # b's prefill launched; a's step read back
    assert scheduler.inflight_prefill is not None and scheduler.running
    pool = scheduler.token_to_kv_pool
    taken = pool.alloc(pool.available_size())  # something else holds every free slot
    scheduler.run_turn()
    assert scheduler.stats.num_retractions == 1 and scheduler.waiting_queue[0].rid == "b"
    pool.free(taken)
    results = run_all(scheduler)
    assert results["a"]["ids"] == expected_output([1, 2, 3, 4, 5], 40)
    assert results["b"]["ids"] == expected_output([6] * 20, 10)
    assert_memory_clean(scheduler)
