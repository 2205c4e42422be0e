"""Speculative decoding with n-gram drafts (scheduler/ngram_draft.py, scheduler/spec_decode.py)
on the fake runner: real pools and radix cache, a model that checks every row's KV against
its tokens. Outputs must equal plain decoding's token for token, rejected drafts' slots must
come back, and the drafts must actually be accepted where the sequence repeats."""
from __future__ import annotations

import random

import numpy as np
import pytest

from radixserve.config import ServerArgs
from radixserve.scheduler.ngram_draft import NgramProposer, propose_from
from radixserve.scheduler.spec_decode import make_proposer
from tests.scheduler.fake_runner import (assert_memory_clean, cyclic_next_token,
                                         expected_output, make_req, make_scheduler,
                                         next_token, run_all)

SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4,
            speculative_ngram_min_match_window_size=1)


def drafts_of(tokens: list[int], k: int = 4, low: int = 1, high: int = 4) -> list[int]:
    return propose_from(np.array(tokens, dtype=np.int64), k, low, high)


def test_propose_takes_the_longest_match_then_the_latest() -> None:
    # suffix [7, 8]: [7, 8] occurs at 0 (then 1, 2) and at 5 (then 3, 4); the suffix 8 alone
    # occurs later at 9 (then 5); the longest (2 tokens) wins, the latest of those
    tokens = [7, 8, 1, 2, 9, 7, 8, 3, 4, 8, 5, 6, 7, 8]
    assert drafts_of(tokens) == [3, 4, 8, 5]
    assert drafts_of(tokens, k=2) == [3, 4]
    assert drafts_of(tokens, low=3) == []  # [6, 7, 8] never occurred before
    assert drafts_of([1, 2, 3]) == []  # nothing to match
    # a run, a short cycle: the match ends inside the suffix, and the repeat goes on
    assert drafts_of([5, 5, 5]) == [5, 5, 5, 5]
    assert drafts_of([1, 2, 3, 1, 2, 3], k=5) == [1, 2, 3, 1, 2]


def test_propose_grows_with_the_request() -> None:
    req = make_req("r", [4, 5, 6, 4, 5], max_new=8)
    from radixserve.core.req import Req
    r = Req(req.rid, req.input_ids, req.sampling_params)
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose(r, 8) == [6, 4, 5]
    r.output_ids += [6, 9]  # appended since: the copy follows, the match moves
    assert proposer.propose(r, 8) == []
    r.output_ids += [4, 5, 6] * 30  # and grows past its first capacity
    assert proposer.propose(r, 2) == [4, 5]
    assert proposer.propose(r, 0) == []


@pytest.mark.parametrize("rule", [cyclic_next_token, next_token])
@pytest.mark.parametrize("steps", [1, 4])
def test_outputs_equal_plain_decoding(rule, steps: int) -> None:
    """Ragged lengths, two model rules (one that repeats itself, so drafts are accepted
    often, and one where they mostly fail): every output is plain decoding's."""
    rng = random.Random(steps)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 30))] for _ in range(9)]
    scheduler, runner = make_scheduler(rule=rule, num_continuous_decode_steps=steps, **SPEC)
    for i, p in enumerate(prompts):
        scheduler.add_request(make_req(f"r{i}", p, max_new=1 + (7 * i) % 41))
    results = run_all(scheduler)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"]["ids"] == expected_output(p, 1 + (7 * i) % 41, rule)
    assert_memory_clean(scheduler)
    state = scheduler.get_internal_state()
    assert state.memory_check_ok
    widest = max(len(b.input_ids) - len(set(b.req_pool_indices)) for b in runner.batches
                 if b.forward_mode.is_decode())
    assert widest > 0  # some step verified drafts
    if rule is cyclic_next_token:
        assert state.spec_accept_rate > 0.5 and state.spec_accept_length > 1.5
        plain, plain_runner = make_scheduler(rule=rule, num_continuous_decode_steps=steps)
        for i, p in enumerate(prompts):
            plain.add_request(make_req(f"r{i}", p, max_new=1 + (7 * i) % 41))
        assert run_all(plain) == results
        steps_of = [sum(b.forward_mode.is_decode() for b in r.batches)
                    for r in (runner, plain_runner)]
        assert steps_of[0] < steps_of[1] / 1.5, steps_of


def test_a_stop_token_inside_accepted_drafts_ends_there() -> None:
    """The stop token is the second of four accepted drafts: the output ends at it, the
    tokens after it are dropped and their slots freed."""
    prompt = [3, 1, 4]
    expected = expected_output(prompt, 40, cyclic_next_token)
    k = next(i for i in range(12, 40) if expected[i] in expected[:i - 4])
    scheduler, _ = make_scheduler(rule=cyclic_next_token, **SPEC)
    scheduler.add_request(make_req("stop", prompt, max_new=40, stop_token_ids=[expected[k]]))
    scheduler.add_request(make_req("len", prompt, max_new=23))
    results = run_all(scheduler)
    first = expected.index(expected[k])
    assert results["stop"]["ids"] == expected[:first + 1]
    assert results["stop"]["finish"] == {"type": "stop", "matched": expected[k]}
    assert results["len"]["ids"] == expected[:23]
    assert_memory_clean(scheduler)


def test_length_and_context_limits_hold() -> None:
    scheduler, runner = make_scheduler(rule=cyclic_next_token, context_len=40, **SPEC)
    scheduler.add_request(make_req("ctx", [5] * 30, max_new=100))
    scheduler.add_request(make_req("len", [6] * 4, max_new=5))
    results = run_all(scheduler)
    assert len(results["ctx"]["ids"]) == 10
    assert results["len"]["ids"] == expected_output([6] * 4, 5, cyclic_next_token)
    assert max(max(b.seq_lens) for b in runner.batches) <= 40
    assert_memory_clean(scheduler)


def test_shared_prompts_reuse_the_cache_after_speculation() -> None:
    """A finished request's KV enters the radix cache; a second request on the same prompt
    reads it back (the fake runner checks each slot's token), so no rejected draft's KV
    was cached as the request's."""
    prompt = [2, 7, 1, 8, 2, 8]
    scheduler, _ = make_scheduler(rule=cyclic_next_token, **SPEC)
    scheduler.add_request(make_req("a", prompt, max_new=30))
    first = run_all(scheduler)
    scheduler.add_request(make_req("b", prompt + first["a"]["ids"][:20], max_new=10))
    second = run_all(scheduler)
    assert second["b"]["meta"]["cached_tokens"] >= len(prompt) + 19
    assert second["b"]["ids"] == expected_output(prompt + first["a"]["ids"][:20], 10,
                                                 cyclic_next_token)
    assert_memory_clean(scheduler)


def test_a_full_pool_drops_the_drafts_and_still_decodes() -> None:
    """A pool too small for the drafts: steps run without them (and retract as plain decoding
    does); outputs unchanged, memory clean."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 50) for _ in range(20)] for _ in range(6)]
    scheduler, _ = make_scheduler(max_total_tokens=150, rule=cyclic_next_token, **SPEC)
    for i, p in enumerate(prompts):
        scheduler.add_request(make_req(f"r{i}", p, max_new=30))
    results = run_all(scheduler)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"]["ids"] == expected_output(p, 30, cyclic_next_token)
    assert_memory_clean(scheduler)


def test_penalties_and_min_new_tokens_do_not_draft() -> None:
    scheduler, runner = make_scheduler(rule=cyclic_next_token, **SPEC)
    scheduler.add_request(make_req("pen", [4, 4, 4], max_new=20, frequency_penalty=0.5))
    scheduler.add_request(make_req("min", [4, 4, 4], max_new=20, min_new_tokens=20))
    run_all(scheduler)
    assert all(len(b.input_ids) == len(set(b.req_pool_indices)) for b in runner.batches
               if b.forward_mode.is_decode())
    assert_memory_clean(scheduler)


def test_models_with_recurrent_state_are_refused(monkeypatch) -> None:
    class Hybrid:
        state_pool = object()
    args = ServerArgs(device="cpu", speculative_algorithm="ngram").resolve()
    with pytest.raises(ValueError, match="running state"):
        make_proposer(args, Hybrid())
    # the decode kernel variant that reads a step's earlier positions before its stores end
    monkeypatch.setenv("RADIXSERVE_DECODE_CONFIG", "64,2,3,0,0,0,1")
    with pytest.raises(ValueError, match="early_kv"):
        make_proposer(args, object())
    with pytest.raises(ValueError, match="speculative-algorithm"):
        ServerArgs(device="cpu", speculative_algorithm="eagle").resolve()


def test_trim_drafts_keeps_a_common_length_within_the_budget() -> None:
    from radixserve.scheduler.spec_decode import trim_drafts
    drafts = [[1, 2, 3, 4], [5], [6, 7, 8], []]
    assert trim_drafts(drafts, 99) is drafts
    assert trim_drafts(drafts, 6) == [[1, 2, 3], [5], [6, 7], []]
    assert trim_drafts(drafts, 5) == [[1, 2], [5], [6, 7], []]
    assert trim_drafts(drafts, 0) == [[], [], [], []]
    assert trim_drafts(drafts, -3) == [[], [], [], []]


def test_verify_passes_stay_within_the_captured_graphs() -> None:
    """With CUDA graphs for up to 6 rows, no pass of 3 requests holds more than 6 rows,
    and the outputs are unchanged."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 50) for _ in range(12)] for _ in range(3)]
    scheduler, runner = make_scheduler(rule=cyclic_next_token, **SPEC)
    runner.decode_graph_rows = 6
    for i, p in enumerate(prompts):
        scheduler.add_request(make_req(f"r{i}", p, max_new=40))
    results = run_all(scheduler)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"]["ids"] == expected_output(p, 40, cyclic_next_token)
    decodes = [b for b in runner.batches if b.forward_mode.is_decode()]
    assert max(len(b.input_ids) for b in decodes) == 6
    assert_memory_clean(scheduler)


def test_accept_counts_survive_a_flush_and_merge_over_replicas() -> None:
    from radixserve.core.io_struct import InternalState
    scheduler, _ = make_scheduler(rule=cyclic_next_token, **SPEC)
    scheduler.add_request(make_req("r", [4, 4, 4], max_new=30))
    run_all(scheduler)
    before = scheduler.get_internal_state()
    assert before.spec_accept_length > 1.5 and 0 < before.spec_accept_rate <= 1
    assert scheduler.flush_cache().success
    after = scheduler.get_internal_state()
    assert after.spec_accept_length == before.spec_accept_length
    idle = make_scheduler(**SPEC)[0].get_internal_state()  # a replica that verified nothing
    merged = InternalState.merge([before, idle])
    assert merged.spec_accept_length == before.spec_accept_length
    assert merged.spec_accept_rate == before.spec_accept_rate
