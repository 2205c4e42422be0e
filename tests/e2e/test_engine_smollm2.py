"""The offline Engine on the bundled SmolLM2-135M-Instruct, against transformers and itself."""
from __future__ import annotations

import pytest
import torch

import radixserve
from radixserve.core.sampling_params import InvalidRequestError
from tests.e2e.conftest import hf_greedy_batch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three colours: red,",
]
GREEDY = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    return radixserve.Engine(dtype="float32")


def test_greedy_matches_transformers_for_64_tokens(engine, hf_smol):
    outs = engine.generate(PROMPTS, GREEDY)
    expected = hf_greedy_batch(hf_smol, [engine.tokenizer.encode(p) for p in PROMPTS], 64)
    for prompt, out, want in zip(PROMPTS, outs, expected):
        assert out["output_ids"] == want, prompt
        assert out["meta_info"]["completion_tokens"] == 64
        assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    engine_state = engine.get_internal_state()
    assert engine_state["memory_check_ok"] and engine_state["leaked_tokens"] == 0


def test_chat_answers_paris(engine):
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
        add_generation_prompt=True)
    out = engine.generate(prompt, {"max_new_tokens": 32, "temperature": 0})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"  # ends on <|im_end|>


def test_logprobs_match_transformers(engine, hf_smol):
    prompt = "The quick brown fox"
    out = engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    ids = engine.tokenizer.encode(prompt)
    full = ids + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_smol(torch.tensor([full])).logits[0].float(), -1)
    out_lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t in out_lps] == out["output_ids"]
    for j, (lp, token) in enumerate(out_lps):
        assert lp == pytest.approx(ref[len(ids) - 1 + j, token].item(), abs=1e-3)
    top = out["meta_info"]["output_top_logprobs"][0]
    assert [t for _, t in top] == ref[len(ids) - 1].topk(3).indices.tolist()
    in_lps = out["meta_info"]["input_token_logprobs"]
    # entry i is prompt token i (SGLang's layout): the first has no logprob
    assert [t for _, t in in_lps] == ids and in_lps[0][0] is None
    for j, (lp, token) in enumerate(in_lps[1:]):
        assert lp == pytest.approx(ref[j, token].item(), abs=1e-3)


def test_streaming_concatenates_to_the_full_text(engine):
    params = {"max_new_tokens": 24, "temperature": 0}
    chunks = list(engine.generate_stream("Tell me about the sea.", params))
    assert len(chunks) > 3 and chunks[-1]["finished"]
    full = engine.generate("Tell me about the sea.", params)
    assert "".join(c["text"] for c in chunks) == full["text"]


def test_n_samples_share_the_prompt_through_the_cache(engine):
    prompt = "Write a haiku about autumn leaves falling on a quiet pond in the evening."
    before = engine.scheduler.stats.total_cached_tokens
    outs = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0.8, "n": 3})
    assert len(outs) == 3
    n_prompt = outs[0]["meta_info"]["prompt_tokens"]
    hits = engine.scheduler.stats.total_cached_tokens - before
    assert hits >= 2 * (n_prompt - 1)  # at least the second and third reuse the first's prompt


def test_seeded_n_samples_differ_and_repeat(engine):
    """Sample j of a seeded request uses seed + j (as the server does): the samples differ from
    each other, and the same call gives the same samples again."""
    params = {"max_new_tokens": 12, "temperature": 1.0, "n": 3, "seed": 11}
    first = engine.generate("Name a colour.", params)
    again = engine.generate("Name a colour.", params)
    ids = [o["output_ids"] for o in first]
    assert ids == [o["output_ids"] for o in again]
    assert len({tuple(i) for i in ids}) > 1


@pytest.mark.parametrize("bad, message", [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"stop": 5}, "stop"),
    ({"stop": [None]}, "stop"),
    ({"temperature": -0.5}, "temperature"),
    ({"frobnicate": 1}, "unknown sampling parameter"),
])
def test_bad_sampling_params_are_refused(engine, bad, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate("hello", bad)
    assert not engine.scheduler.has_work()


def test_bad_prompts_are_refused_without_leaks(engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate(input_ids=[], sampling_params={"max_new_tokens": 4})
    too_long = [1] * engine.scheduler.context_len
    with pytest.raises(InvalidRequestError, match="context length"):
        engine.generate(input_ids=too_long, sampling_params={"max_new_tokens": 4})
    # the server's rule too (one validation path): prompt + max_new_tokens past the context
    budget = engine.scheduler.context_len - 10
    with pytest.raises(InvalidRequestError, match="Reduce the prompt or max_tokens"):
        engine.generate(input_ids=[1] * budget, sampling_params={"max_new_tokens": 11})
    with pytest.raises(InvalidRequestError, match="logprob_start_len"):
        engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1},
                        return_logprob=True, logprob_start_len=2)
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0


def _greedy_outputs(ignore_eos: bool = True, **engine_args
                    ) -> tuple[list[list[int]], radixserve.Engine]:
    eng = radixserve.Engine(dtype="float32", **engine_args)
    shared = "You are a helpful assistant. Answer briefly and precisely. Question: "
    prompts = [shared + q for q in ("What is two plus two?", "Name a fruit.",
                                    "What colour is the sky?", "Who wrote Hamlet?")]
    prompts += PROMPTS
    outs = eng.generate(prompts, {"max_new_tokens": 40, "temperature": 0,
                                  "ignore_eos": ignore_eos})
    state = eng.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    return [o["output_ids"] for o in outs], eng


@pytest.fixture(scope="module")
def reference_outputs():
    outs, _ = _greedy_outputs(max_total_tokens=20000, chunked_prefill_size=-1)
    return outs


@pytest.mark.slow  # 27 s; retraction's outputs on tiny checkpoints: tests/scheduler, in CI
def test_tiny_kv_pool_forces_retraction_with_identical_outputs(reference_outputs):
    """Requests that may stop at EOS are admitted on the ratio estimate, which a low
    conservativeness makes over-admit (ignore_eos requests pass the exact peak check and are
    never retracted). Each output is the reference's up to its EOS."""
    outs, eng = _greedy_outputs(ignore_eos=False, max_total_tokens=160,
                                schedule_conservativeness=0.05)
    assert eng.scheduler.stats.num_retractions > 0
    eos = eng.scheduler.eos_token_ids
    for out, ref in zip(outs, reference_outputs):
        assert out == ref[:len(out)]
        assert len(out) == 40 or out[-1] in eos


@pytest.mark.slow  # 18 s; the cache off: tests/scheduler/test_scheduler.py, in CI
def test_radix_cache_off_gives_identical_outputs(reference_outputs):
    outs, eng = _greedy_outputs(disable_radix_cache=True, chunked_prefill_size=-1)
    assert eng.scheduler.stats.total_cached_tokens == 0
    assert outs == reference_outputs


@pytest.mark.parametrize("chunk, mixed", [pytest.param(16, False, marks=pytest.mark.slow),
                                          (16, True),
                                          pytest.param(64, False, marks=pytest.mark.slow),
                                          pytest.param(1024, True, marks=pytest.mark.slow)])
def test_chunked_prefill_gives_identical_outputs(reference_outputs, chunk, mixed):
    outs, _ = _greedy_outputs(chunked_prefill_size=chunk, enable_mixed_chunk=mixed)
    assert outs == reference_outputs


@pytest.fixture(scope="module")
def overlap_pair():
    """Two engines, decode overlap on (the default) and off, both admitting prompts in 8-token
    chunks, so prefills are read back over several turns while other requests decode."""
    engines = {overlap: radixserve.Engine(dtype="float32", chunked_prefill_size=8,
                                          disable_overlap_schedule=not overlap)
               for overlap in (True, False)}
    yield engines
    for eng in engines.values():
        eng.shutdown()


def _on_and_off(overlap_pair, run) -> list:
    """run(engine) on the overlap engine and then the synchronous one; each must end with its
    memory all free."""
    results = []
    for overlap in (True, False):
        eng = overlap_pair[overlap]
        results.append(run(eng))
        state = eng.get_internal_state()
        assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    return results


def test_overlap_on_and_off_give_identical_outputs_and_stops(overlap_pair):
    """Decode overlap (the default) against synchronous steps on the real model: requests that
    stop on EOS, on a stop string (both found a step late under overlap) or by length at
    different steps give the same tokens and finish reasons, and free all their memory."""
    prompts = PROMPTS + ["Count: one, two, three,", "The capital of France is"]
    params = [{"max_new_tokens": 5 + 7 * i, "temperature": 0,
               "stop": ["."] if i % 2 else None} for i in range(len(prompts))]
    results = _on_and_off(overlap_pair, lambda eng: [
        (o["output_ids"], o["meta_info"]["finish_reason"])
        for o in eng.generate(prompts, params)])
    assert results[0] == results[1]
    reasons = {str(r[1]) for r in results[0]}
    assert len(reasons) > 1  # more than one way of finishing was exercised


def test_overlap_carries_penalties_and_seeds_exactly(overlap_pair):
    """Seeded sampling and penalties under overlap read the sampling state carried on the device
    (rows kept, advanced by the token in flight, and joined by the rows of requests whose
    prefill is read back meanwhile: 8-token chunks admit the prompts over several turns); it
    must equal the state rebuilt from the requests' outputs each step: the same tokens with
    overlap on and off."""
    prompts = PROMPTS + ["List three animals:"]
    params = [
        {"max_new_tokens": 24, "temperature": 0.9, "seed": 3, "frequency_penalty": 0.8},
        {"max_new_tokens": 9, "temperature": 0, "repetition_penalty": 1.3},
        {"max_new_tokens": 30, "temperature": 0.7, "seed": 11, "presence_penalty": 0.5,
         "min_new_tokens": 20},
        {"max_new_tokens": 16, "temperature": 1.0, "seed": 5, "top_k": 20, "top_p": 0.9},
    ][:len(prompts)]
    prompts = prompts[:len(params)]
    results = _on_and_off(overlap_pair, lambda eng: [
        o["output_ids"] for o in eng.generate(prompts, params)])
    assert results[0] == results[1]
    assert [len(ids) for ids in results[0]][1] == 9


def test_overlap_returns_the_same_logprobs(overlap_pair):
    """Logprobs under overlap are computed with the step and copied back with its ids."""
    prompts = PROMPTS[:3]
    params = [{"max_new_tokens": 6 + 5 * i, "temperature": 0} for i in range(len(prompts))]
    results = _on_and_off(overlap_pair, lambda eng: [
        (o["output_ids"], o["meta_info"]["output_token_logprobs"],
         o["meta_info"]["output_top_logprobs"])
        for o in eng.generate(prompts, params, return_logprob=True, top_logprobs_num=3)])
    for (ids_a, lps_a, tops_a), (ids_b, lps_b, tops_b) in zip(*results):
        assert ids_a == ids_b and len(lps_a) == len(ids_a) and len(tops_a) == len(ids_a)
        assert [t for _, t in lps_a] == ids_a
        assert [lp for lp, _ in lps_a] == pytest.approx([lp for lp, _ in lps_b], abs=1e-4)
        for top_a, top_b in zip(tops_a, tops_b):
            assert [t for _, t in top_a] == [t for _, t in top_b] and len(top_a) == 3
            assert [v for v, _ in top_a] == pytest.approx([v for v, _ in top_b], abs=1e-4)
