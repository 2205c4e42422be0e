"""Scheduler behaviour with a fake model runner (real pools, real radix cache)."""
from __future__ import annotations

import random

import pytest

from radixserve.scheduler.retraction import (BASE_MIN_NEW_TOKEN_RATIO, INIT_NEW_TOKEN_RATIO,
                                             NEW_TOKEN_RATIO_DECAY)
from radixserve.core.forward_batch import ForwardOutput
from tests.scheduler import fake_runner
from tests.scheduler.fake_runner import (EOS, assert_memory_clean, expected_output, make_req,
                                         make_scheduler, run_all)


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight", "random"])
@pytest.mark.parametrize("radix", [True, False])
def test_all_requests_finish_with_correct_outputs(policy, radix):
    scheduler, _ = make_scheduler(schedule_policy=policy, disable_radix_cache=not radix)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    ps = [shared + p for p in prompts(6, 10)] + prompts(4, 30, seed=1)
    for i, p in enumerate(ps):
        assert scheduler.add_request(make_req(f"r{i}", p, max_new=12)) is None
    results = run_all(scheduler)
    for i, p in enumerate(ps):
        assert results[f"r{i}"]["ids"] == expected_output(p, 12)
        assert results[f"r{i}"]["finish"] == {"type": "length", "length": 12}
    assert_memory_clean(scheduler)


def test_shared_prefix_is_reused():
    scheduler, _ = make_scheduler()
    shared = list(range(1, 41))
    assert scheduler.add_request(make_req("first", shared + [1], max_new=2)) is None
    run_all(scheduler)
    for i in range(3):
        scheduler.add_request(make_req(f"r{i}", shared + [2 + i, 3], max_new=2))
    results = run_all(scheduler)
    for i in range(3):
        assert results[f"r{i}"]["meta"]["cached_tokens"] >= 40
    assert scheduler.stats.total_cached_tokens >= 120
    assert_memory_clean(scheduler)


def test_new_token_ratio_decays_to_floor_and_resets():
    # synchronous steps: the ratio decays as each step's tokens are read back, which overlap
    # delays by one turn (tests/scheduler/test_overlap.py covers that path)
    scheduler, _ = make_scheduler(schedule_conservativeness=1.0, num_continuous_decode_steps=1,
                                  disable_overlap_schedule=True)
    assert scheduler.ratio.value == pytest.approx(INIT_NEW_TOKEN_RATIO)
    scheduler.add_request(make_req("a", [1, 2, 3], max_new=60))
    scheduler.run_turn()  # prefill
    for step in range(1, 11):
        scheduler.run_turn()
        assert scheduler.ratio.value == pytest.approx(INIT_NEW_TOKEN_RATIO
                                                      - step * NEW_TOKEN_RATIO_DECAY)
    scheduler.ratio.value = BASE_MIN_NEW_TOKEN_RATIO + NEW_TOKEN_RATIO_DECAY / 2
    scheduler.run_turn()
    assert scheduler.ratio.value == pytest.approx(BASE_MIN_NEW_TOKEN_RATIO)
    run_all(scheduler)
    assert scheduler.ratio.value == pytest.approx(INIT_NEW_TOKEN_RATIO)  # idle resets it


def test_conservativeness_scales_the_floor():
    scheduler, _ = make_scheduler(schedule_conservativeness=2.0)
    assert scheduler.ratio.min_value == pytest.approx(2 * BASE_MIN_NEW_TOKEN_RATIO)


def test_admission_reserves_running_requests_future_tokens():
    """available = free + evictable - sum(remaining max_new) * ratio decides admission."""
    scheduler, runner = make_scheduler(max_total_tokens=400, num_continuous_decode_steps=1,
                                       context_len=512)
    scheduler.add_request(make_req("long", [1] * 10, max_new=300))
    scheduler.run_turn()  # prefill "long"
    assert len(scheduler.admitted_reqs()) == 1
    # reserved = 299 * 0.7 ~ 209; free ~ 389 - 209 = 180 < 100 + 100: refused for now
    scheduler.add_request(make_req("big", [2] * 100, max_new=100))
    scheduler.run_turn()
    assert [r.rid for r in scheduler.waiting_queue] == ["big"]
    # v0.2 admits in policy order and stops at the first request that does not fit
    scheduler.add_request(make_req("small", [3] * 10, max_new=10))
    scheduler.run_turn()
    assert [r.rid for r in scheduler.admitted_reqs()] == ["long"]
    # without the big one ahead of it, the small one fits the estimate
    scheduler.abort_request("big")
    outs = scheduler.run_turn()
    assert outs[0].rids == ["big"] and outs[0].finished_reasons[0]["type"] == "abort"
    assert "small" in [r.rid for r in scheduler.admitted_reqs()]
    results = run_all(scheduler)
    assert results["small"]["ids"] == expected_output([3] * 10, 10)
    assert_memory_clean(scheduler)


def test_max_prefill_tokens_splits_prefill_batches():
    scheduler, runner = make_scheduler(max_prefill_tokens=64, chunked_prefill_size=-1)
    for i, p in enumerate(prompts(5, 30)):
        scheduler.add_request(make_req(f"r{i}", p, max_new=2))
    run_all(scheduler)
    extend_batches = [b for b in runner.batches if not b.forward_mode.is_decode()]
    assert len(extend_batches) >= 3
    assert all(sum(b.extend_seq_lens) <= 64 for b in extend_batches)


def test_retraction_when_decode_runs_out_of_memory():
    big = 4000
    ps = prompts(8, 20, seed=3)
    ref_scheduler, _ = make_scheduler(max_total_tokens=big)
    for i, p in enumerate(ps):
        ref_scheduler.add_request(make_req(f"r{i}", p, max_new=40))
    reference = run_all(ref_scheduler)

    scheduler, _ = make_scheduler(max_total_tokens=260, schedule_conservativeness=0.05)
    for i, p in enumerate(ps):
        scheduler.add_request(make_req(f"r{i}", p, max_new=40))
    results = run_all(scheduler)
    assert scheduler.stats.num_retractions > 0
    # the retracted requests' evicted tokens were prefilled again, and the state reports it
    state = scheduler.get_internal_state()
    assert state.num_recomputed_tokens == scheduler.stats.num_recomputed_tokens > 0
    assert scheduler.ratio.value == pytest.approx(scheduler.ratio.init_value)  # reset when idle
    for rid, ref in reference.items():
        assert results[rid]["ids"] == ref["ids"]
        assert results[rid]["finish"] == ref["finish"]
    assert_memory_clean(scheduler)


def test_retraction_picks_fewest_output_tokens_and_raises_ratio():
    scheduler, _ = make_scheduler(max_total_tokens=120, schedule_conservativeness=0.01,
                                  num_continuous_decode_steps=1)
    scheduler.add_request(make_req("old", [1] * 20, max_new=80))
    scheduler.run_turn()  # prefill old
    for _ in range(10):
        scheduler.run_turn()
    # admitted: 20 + 60 fits the estimate, but old (100) + new (80) > 120 tokens later
    scheduler.add_request(make_req("new", [2] * 20, max_new=60))
    scheduler.run_turn()
    assert "new" in [r.rid for r in scheduler.admitted_reqs()]
    ratio_before = scheduler.ratio.value
    for _ in range(100):
        if scheduler.stats.num_retractions:
            break
        scheduler.run_turn()
    assert [r.rid for r in scheduler.running] == ["old"]
    retracted = scheduler.waiting_queue[0]
    assert retracted.rid == "new" and len(retracted.output_ids) > 0  # keeps its output
    assert scheduler.ratio.value > ratio_before
    results = run_all(scheduler)
    assert results["new"]["ids"] == expected_output([2] * 20, 60)
    assert results["old"]["ids"] == expected_output([1] * 20, 80)
    assert_memory_clean(scheduler)


def test_decode_steps_per_turn_and_early_break_for_streaming():
    scheduler, runner = make_scheduler(num_continuous_decode_steps=5,
                                       disable_overlap_schedule=True)
    scheduler.add_request(make_req("a", [1, 2, 3], max_new=50))
    scheduler.run_turn()  # prefill
    before = len(runner.batches)
    outs = scheduler.run_turn()
    assert len(runner.batches) - before == 5  # non-streaming: all five steps
    assert outs == []  # nothing to send before it finishes
    scheduler.add_request(make_req("s", [4, 5, 6], max_new=50, stream=True))
    scheduler.run_turn()  # prefill s
    before = len(runner.batches)
    outs = scheduler.run_turn()
    assert len(runner.batches) - before == 1  # streamed output waits: break after one step
    assert "s" in outs[0].rids
    run_all(scheduler)


def test_stop_conditions():
    scheduler, _ = make_scheduler(context_len=40)
    p = [1, 2, 3]
    expected = expected_output(p, 20)
    k = next(i for i in range(3, 20) if expected[i] not in expected[:i])
    scheduler.add_request(make_req("stop_id", p, max_new=20, stop_token_ids=[expected[k]]))
    scheduler.add_request(make_req("ctx", [5] * 30, max_new=100))
    results = run_all(scheduler)
    assert results["stop_id"]["ids"] == expected[:k + 1]
    assert results["stop_id"]["finish"] == {"type": "stop", "matched": expected[k]}
    assert len(results["ctx"]["ids"]) == 10  # 30 + 10 == context length
    assert results["ctx"]["finish"]["type"] == "length"


def test_eos_and_ignore_eos(monkeypatch):
    import tests.scheduler.fake_runner as fake
    monkeypatch.setattr(fake, "next_token", lambda last, pos: EOS if pos == 6 else 9)
    scheduler, _ = make_scheduler()
    scheduler.add_request(make_req("eos", [1, 2, 3], max_new=10))
    scheduler.add_request(make_req("ignore", [1, 2, 3], max_new=10, ignore_eos=True))
    scheduler.add_request(make_req("min", [1, 2, 3], max_new=10, min_new_tokens=6))
    results = run_all(scheduler)
    assert results["eos"]["ids"] == [9, 9, 9, 9, EOS]
    assert results["eos"]["finish"] == {"type": "stop", "matched": EOS}
    assert len(results["ignore"]["ids"]) == 10
    assert len(results["min"]["ids"]) == 10  # EOS at 5 tokens is below min_new_tokens


def test_a_stop_on_the_last_allowed_token_is_a_stop(monkeypatch):
    # the token that reaches max_new_tokens (or the context length) is also a stop token, or
    # completes a stop string: the finish is "stop" (OpenAI and vLLM), not "length"
    import tests.scheduler.fake_runner as fake
    # the 5th output of a 3-token prompt sits at position 6; a 35-token prompt's 5th at 38
    monkeypatch.setattr(fake, "next_token",
                        lambda last, pos: EOS if pos == 6 else 8 if pos == 38 else 9)
    scheduler, _ = make_scheduler(context_len=40)
    scheduler.add_request(make_req("eos", [1, 2, 3], max_new=5))
    scheduler.add_request(make_req("ctx", [5] * 35, max_new=100, stop_token_ids=[8]))
    results = run_all(scheduler)
    assert results["eos"]["ids"] == [9, 9, 9, 9, EOS]
    assert results["eos"]["finish"] == {"type": "stop", "matched": EOS}
    assert results["ctx"]["ids"] == [9, 9, 9, 9, 8]  # 35 + 5 == context length
    assert results["ctx"]["finish"] == {"type": "stop", "matched": 8}


def test_stop_strings_use_the_tokenizer():
    class CharTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i % 26) for i in ids)

    scheduler, _ = make_scheduler()
    scheduler.tokenizer = CharTokenizer()
    p = [1, 2, 3]
    exp = expected_output(p, 20)
    stop = CharTokenizer().decode(exp[6:8])
    first = CharTokenizer().decode(exp).find(stop)
    scheduler.add_request(make_req("s", p, max_new=20, stop=[stop]))
    # the token that completes the stop string is also the last max_new_tokens allows
    scheduler.add_request(make_req("last", p, max_new=first + len(stop), stop=[stop]))
    results = run_all(scheduler)
    for rid in ("s", "last"):
        assert results[rid]["finish"] == {"type": "stop", "matched": stop}
        assert len(results[rid]["ids"]) == first + len(stop)


@pytest.mark.parametrize("stage", ["waiting", "running", "chunked"])
def test_abort_at_every_stage_frees_everything(stage):
    scheduler, _ = make_scheduler(chunked_prefill_size=16, num_continuous_decode_steps=1)
    scheduler.add_request(make_req("other", [9] * 5, max_new=30))
    length = 100 if stage == "chunked" else 10
    scheduler.add_request(make_req("victim", [7] * length, max_new=30))
    if stage == "running":
        while "victim" not in [r.rid for r in scheduler.running]:
            scheduler.run_turn()
    elif stage == "chunked":
        while scheduler.chunked_req is None:
            scheduler.run_turn()
        assert scheduler.chunked_req.rid == "victim"
    scheduler.abort_request("victim")
    results = run_all(scheduler)
    assert results["victim"]["finish"]["type"] == "abort"
    assert results["other"]["ids"] == expected_output([9] * 5, 30)
    assert_memory_clean(scheduler)


def test_bad_requests_are_refused_before_scheduling():
    scheduler, _ = make_scheduler(max_total_tokens=100, context_len=64,
                                  chunked_prefill_size=-1, max_prefill_tokens=32)
    assert "empty" in scheduler.add_request(make_req("e", [], max_new=1)).message
    err = scheduler.add_request(make_req("c", [1] * 64, max_new=1)).message
    assert "64" in err and "context length" in err
    assert "max-prefill-tokens" in scheduler.add_request(make_req("p", [1] * 40)).message
    assert "input_ids" in scheduler.add_request(make_req("v", [1, 999])).message
    assert not scheduler.has_work()
    assert_memory_clean(scheduler)


def test_queue_limit_answers_429():
    scheduler, _ = make_scheduler(max_queued_requests=2)
    assert scheduler.add_request(make_req("a", [1])) is None
    assert scheduler.add_request(make_req("b", [1])) is None
    err = scheduler.add_request(make_req("c", [1]))
    assert err is not None and err.http_status == 429
    run_all(scheduler)


def test_lpm_puts_longest_cached_prefix_first():
    scheduler, _ = make_scheduler(schedule_policy="lpm")
    cached = list(range(1, 31))
    scheduler.add_request(make_req("warm", cached, max_new=1))
    run_all(scheduler)
    scheduler.add_request(make_req("cold", [40] * 30, max_new=1))
    scheduler.add_request(make_req("hot", cached[:29] + [45], max_new=1))
    order = scheduler.policy.order(scheduler.waiting_queue)
    assert [r.rid for r in order] == ["hot", "cold"]
    scheduler.policy.policy = "fcfs"
    assert [r.rid for r in scheduler.policy.order(scheduler.waiting_queue)] == ["cold", "hot"]
    run_all(scheduler)


def test_dfs_weight_groups_requests_by_subtree():
    scheduler, _ = make_scheduler(schedule_policy="dfs-weight")
    a, b = [1] * 20, [2] * 20
    scheduler.add_request(make_req("wa", a + [3], max_new=1))
    scheduler.add_request(make_req("wb", b + [3], max_new=1))
    run_all(scheduler)
    for rid, p in [("a1", a + [4]), ("b1", b + [4]), ("a2", a + [5]), ("a3", a + [6])]:
        scheduler.add_request(make_req(rid, p, max_new=1))
    order = [r.rid for r in scheduler.policy.order(scheduler.waiting_queue)]
    assert order[:3] == sorted(order[:3]) and set(order[:3]) == {"a1", "a2", "a3"}
    assert order[3] == "b1"
    run_all(scheduler)


@pytest.mark.parametrize("chunk", [4, 16, 64, -1])
def test_chunked_prefill_keeps_outputs(chunk):
    scheduler, runner = make_scheduler(chunked_prefill_size=chunk)
    shared = list(range(1, 50))
    ps = [shared[:37] + [7, 8], [3 + i % 40 for i in range(87)], [5] * 3, shared + [1, 2, 3]]
    for i, p in enumerate(ps):
        scheduler.add_request(make_req(f"r{i}", p, max_new=6))
    results = run_all(scheduler)
    for i, p in enumerate(ps):
        assert results[f"r{i}"]["ids"] == expected_output(p, 6)
    if chunk > 0:
        assert all(sum(b.extend_seq_lens) <= chunk for b in runner.batches
                   if not b.forward_mode.is_decode())
    assert_memory_clean(scheduler)


def test_long_prompt_served_with_chunking():
    scheduler, _ = make_scheduler(chunked_prefill_size=16, max_prefill_tokens=32)
    p = [3] * 150
    assert scheduler.add_request(make_req("long", p, max_new=4)) is None
    assert run_all(scheduler)["long"]["ids"] == expected_output(p, 4)
    assert_memory_clean(scheduler)


def test_max_new_tokens_zero_caches_the_prompt():
    scheduler, _ = make_scheduler()
    p = list(range(1, 30))
    scheduler.add_request(make_req("warm", p, max_new=0))
    results = run_all(scheduler)
    assert results["warm"]["ids"] == [] and results["warm"]["finish"]["length"] == 0
    assert scheduler.tree_cache.total_size() == len(p)
    assert_memory_clean(scheduler)


def test_mixed_chunk_runs_prefill_and_decode_in_one_pass():
    from radixserve.core.forward_batch import ForwardMode
    scheduler, runner = make_scheduler(chunked_prefill_size=16, enable_mixed_chunk=True,
                                       num_continuous_decode_steps=1)
    streams = prompts(4, 8, seed=5)
    for i, p in enumerate(streams):
        scheduler.add_request(make_req(f"s{i}", p, max_new=40))
    scheduler.run_turn()
    long_prompt = [7 + i % 30 for i in range(100)]
    scheduler.add_request(make_req("long", long_prompt, max_new=5))
    results = run_all(scheduler)
    mixed = [b for b in runner.batches if b.forward_mode is ForwardMode.MIXED]
    # the long prompt's chunks of 16, each alongside the four decoding streams
    long_chunks = [b for b in mixed if b.extend_seq_lens[0] > 1
                   and b.extend_seq_lens[1:] == [1, 1, 1, 1]]
    assert len(long_chunks) >= 6
    for i, p in enumerate(streams):
        assert results[f"s{i}"]["ids"] == expected_output(p, 40)
    assert results["long"]["ids"] == expected_output(long_prompt, 5)
    assert_memory_clean(scheduler)


def test_flush_cache_returns_every_slot():
    scheduler, _ = make_scheduler()
    scheduler.add_request(make_req("a", list(range(1, 40)), max_new=5))
    run_all(scheduler)
    assert scheduler.tree_cache.total_size() > 0
    assert scheduler.flush_cache().success
    assert scheduler.tree_cache.total_size() == 0
    assert scheduler.token_to_kv_pool.available_size() == scheduler.max_total_num_tokens
    assert_memory_clean(scheduler)


def test_retraction_while_a_prompt_is_being_chunked():
    """With mixed chunks, decode runs (and can run out of memory) between a prompt's chunks."""
    ps = prompts(6, 12, seed=9)
    long_prompt = [4 + i % 40 for i in range(200)]
    ref, _ = make_scheduler(max_total_tokens=4000)
    for i, p in enumerate(ps):
        ref.add_request(make_req(f"s{i}", p, max_new=60))
    ref.add_request(make_req("long", long_prompt, max_new=5))
    reference = run_all(ref)

    scheduler, _ = make_scheduler(max_total_tokens=330, chunked_prefill_size=8,
                                  enable_mixed_chunk=True, schedule_conservativeness=0.05,
                                  num_continuous_decode_steps=2)
    for i, p in enumerate(ps):
        scheduler.add_request(make_req(f"s{i}", p, max_new=60))
    while len(scheduler.running) < len(ps):
        scheduler.run_turn()
    scheduler.add_request(make_req("long", long_prompt, max_new=5))
    results: dict[str, list[int]] = {}
    retracted_mid_chunk = False
    for _ in range(3000):
        if not scheduler.has_work():
            break
        before = scheduler.stats.num_retractions
        for out in scheduler.run_turn():
            for rid, new in zip(out.rids, out.new_output_ids):
                results.setdefault(rid, []).extend(new)
        if scheduler.stats.num_retractions > before and scheduler.chunked_req is not None:
            retracted_mid_chunk = True
    assert retracted_mid_chunk
    for rid, entry in reference.items():
        assert results[rid] == entry["ids"]
    assert_memory_clean(scheduler)


def test_decode_steps_interleave_with_chunks():
    """Without mixed passes, streams still get a decode step between two chunks."""
    scheduler, runner = make_scheduler(chunked_prefill_size=16, num_continuous_decode_steps=4)
    for i, p in enumerate(prompts(3, 6, seed=2)):
        scheduler.add_request(make_req(f"s{i}", p, max_new=60))
    while len(scheduler.running) < 3:
        scheduler.run_turn()
    start = len(runner.batches)
    long_prompt = [5 + i % 30 for i in range(100)]
    scheduler.add_request(make_req("long", long_prompt, max_new=3))
    results = run_all(scheduler)
    modes = [b.forward_mode.is_decode() for b in runner.batches[start:]]
    first_decode_after_long = modes.index(True)
    chunk_turns = modes[:first_decode_after_long + 12]
    # extend, decode, extend, decode, ...: never two chunks in a row while streams run
    assert not any(a is False and b is False for a, b in zip(chunk_turns, chunk_turns[1:]))
    assert results["long"]["ids"] == expected_output(long_prompt, 3)
    assert_memory_clean(scheduler)


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_a_long_queue_loses_exactly_what_a_turn_admits(policy):
    """Over a queue longer than lpm's matching limit both policies admit in queue order, and
    only the front the turn looked at is rebuilt: the rest keeps its order, a request skipped
    in the front (its grammar still compiling) stays in place, and every request finishes."""
    scheduler, _ = make_scheduler(max_total_tokens=4000, max_reqs=8, schedule_policy=policy)
    ps = prompts(200, 6, seed=3)
    for i, p in enumerate(ps):
        assert scheduler.add_request(make_req(f"q{i}", p, max_new=2)) is None
    skipped = scheduler.waiting_queue[1]
    ready = scheduler.grammars.ready
    scheduler.grammars.ready = lambda req: req is not skipped and ready(req)
    before = [r.rid for r in scheduler.waiting_queue]
    assert scheduler.policy.keeps_queue_order(len(before))
    scheduler.run_turn()
    after = [r.rid for r in scheduler.waiting_queue]
    gone = set(before) - set(after)
    assert gone and "q1" not in gone and len(after) == len(set(after))
    assert after == [rid for rid in before if rid not in gone]  # the rest in order
    assert max(before.index(rid) for rid in gone) == len(gone)  # the front, less q1
    scheduler.grammars.ready = ready
    results = run_all(scheduler)
    assert all(results[f"q{i}"]["ids"] == expected_output(p, 2) for i, p in enumerate(ps))
    assert_memory_clean(scheduler)


def test_a_chunked_prompts_own_chunks_are_no_cache_hits() -> None:
    """A unique prompt prefilled in chunks: its later chunks extend its own earlier ones,
    which the hit rate must not count (it read 0.65 on a cold prompt); the same prompt again
    is a real hit."""
    scheduler, _ = make_scheduler(chunked_prefill_size=16, num_continuous_decode_steps=1)
    prompt = [1 + (7 * i) % 48 for i in range(60)]
    assert scheduler.add_request(make_req("cold", prompt, max_new=2)) is None
    run_all(scheduler)
    assert scheduler.stats.total_cached_tokens == 0 and scheduler.stats.cache_hit_rate == 0
    assert scheduler.add_request(make_req("warm", prompt, max_new=2)) is None
    run_all(scheduler)
    assert scheduler.stats.total_cached_tokens > 0


def test_the_decode_logs_throughput_restarts_after_idle() -> None:
    """An idle scheduler restarts the decode log's clock and count, so the first line after a
    pause reports the throughput of the work, not diluted by the idle time."""
    scheduler, _ = make_scheduler()
    scheduler.stats.last_log_time, scheduler.stats.generated_since_log = 0.0, 99
    assert scheduler.add_request(make_req("a", [1, 2, 3], max_new=2)) is None
    run_all(scheduler)
    scheduler.run_turn()  # idle
    assert scheduler.stats.last_log_time > 0.0 and scheduler.stats.generated_since_log == 0


def test_a_chunk_whose_memory_the_decodes_took_makes_them_step_aside():
    """Without mixed passes a decode turn runs between two chunks and can use the slots the
    next chunk was admitted against (a probe's server died of OutOfMemoryError: a 97-token
    prompt decoding 1050 tokens, then a 1860-token prompt in 64-token chunks, a 3000-slot
    pool). The decodes now step aside; every output is the one it would have been."""
    scheduler, _ = make_scheduler(max_total_tokens=3000, context_len=8192,
                                  chunked_prefill_size=64)
    first, second = [4 + i % 40 for i in range(97)], [5 + i % 37 for i in range(1860)]
    scheduler.add_request(make_req("a", first, max_new=1050))
    while not scheduler.running or len(scheduler.running[0].output_ids) < 1020:
        scheduler.run_turn()
    scheduler.add_request(make_req("b", second, max_new=1))
    results = run_all(scheduler)
    assert results["a"]["ids"] == expected_output(first, 1050)
    assert results["b"]["ids"] == expected_output(second, 1)
    assert_memory_clean(scheduler)



# CI runs the overlapped case; --run-slow the others (8 s each)
@pytest.mark.parametrize("chunk,overlap,decoded", [pytest.param(2, False, 40,
                                                                marks=pytest.mark.slow),
                                                   (2, True, 300),
                                                    pytest.param(3, True, 300,
                                                                 marks=pytest.mark.slow)])
def test_a_request_being_chunked_steps_aside_for_a_running_request_that_must_grow(
        chunk, overlap, decoded):
    """A prompt being chunked holds KV between its chunks. When a running request alone
    cannot grow beside it, the chunked prompt steps aside (back to the queue, its chunks so
    far cached); the running request is not ended short (a probe's server ended one with
    finish `length` at 1317 of 2900 tokens: a 3000-slot pool, 2-token chunks, a 1955-token
    prompt arriving during a 97-token prompt's long decode)."""
    scheduler, _ = make_scheduler(max_total_tokens=3000, context_len=8192,
                                  chunked_prefill_size=chunk, num_continuous_decode_steps=1,
                                  disable_overlap_schedule=not overlap)
    first, second = [4 + i % 40 for i in range(97)], [5 + i % 37 for i in range(1955)]
    scheduler.add_request(make_req("a", first, max_new=2900))
    while not scheduler.running or len(scheduler.running[0].output_ids) < decoded:
        scheduler.run_turn()
    scheduler.ratio.value = scheduler.ratio.min_value  # a long decode decays it to the floor
    scheduler.add_request(make_req("b", second, max_new=8))
    results = run_all(scheduler, max_turns=100000)
    assert results["a"]["finish"] == {"type": "length", "length": 2900}
    assert results["a"]["ids"] == expected_output(first, 2900)
    assert results["b"]["ids"] == expected_output(second, 8)
    assert scheduler.stats.num_retractions == 1  # the chunked prompt, once
    assert_memory_clean(scheduler)


class _PromptLogprobRunner(fake_runner.FakeRunner):
    """The fake model, with a prompt logprob (0.0) for every prompt position asked for."""

    def forward(self, batch):  # type: ignore[no-untyped-def]
        ids = self._run(batch, batch.input_ids)
        if not batch.return_logprob:
            return ForwardOutput(ids)
        prompt = None if batch.forward_mode.is_decode() else [
            [(0.0, t) for t in following] for following in batch.extend_next_token_ids]
        return ForwardOutput(ids, [0.0] * len(ids), None, prompt, None)


def _prompt_logprobs(scheduler, msg) -> list:  # type: ignore[no-untyped-def]
    scheduler.add_request(msg)
    got: list = []
    for _ in range(100000):
        if not scheduler.has_work():
            break
        for out in scheduler.run_turn():
            for i, rid in enumerate(out.rids):
                if rid == msg.rid:
                    got += out.meta_infos[i].get("input_token_logprobs") or []
    return got


# 18 s each (thousands of one-step turns); the set-aside itself: the test above, in CI
@pytest.mark.parametrize("overlap", [pytest.param(False, marks=pytest.mark.slow),
                                     pytest.param(True, marks=pytest.mark.slow)])
def test_a_prompt_set_aside_returns_its_prompt_logprobs_once(overlap, monkeypatch) -> None:
    """A chunked prompt asking for prompt logprobs and set aside for a running request
    computes them again from its logprob start: they are returned once (3864 entries came
    back for a 1955-token prompt), as when it runs alone."""
    import dataclasses

    monkeypatch.setattr(fake_runner, "FakeRunner", _PromptLogprobRunner)
    args = dict(max_total_tokens=3000, context_len=8192, chunked_prefill_size=2,
                num_continuous_decode_steps=1, disable_overlap_schedule=not overlap)
    second = [5 + i % 37 for i in range(1955)]
    msg = dataclasses.replace(make_req("b", second, max_new=8), return_logprob=True,
                              logprob_start_len=0)
    alone = _prompt_logprobs(make_scheduler(**args)[0], msg)
    scheduler, _ = make_scheduler(**args)
    scheduler.add_request(make_req("a", [4 + i % 40 for i in range(97)], max_new=2900))
    while not scheduler.running or len(scheduler.running[0].output_ids) < 40:
        scheduler.run_turn()
    scheduler.ratio.value = scheduler.ratio.min_value
    squeezed = _prompt_logprobs(scheduler, dataclasses.replace(msg))
    assert scheduler.stats.num_retractions == 1
    assert len(alone) == len(second) and squeezed == alone
    assert_memory_clean(scheduler)
