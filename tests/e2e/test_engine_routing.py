"""The offline Engine when several callers drive one scheduler: a suspended stream and a
`generate`, interleaved streams, a stream left without closing it, two threads at once; each
request gets exactly its own tokens (the same as alone, greedy, fp32), nothing hangs or leaks.
Also clear errors for odd inputs and for use after shutdown."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import radixserve
from radixserve.core.sampling_params import InvalidRequestError

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
A, B = "Once upon a time", "The capital of France is"


@pytest.fixture(scope="module")
def engine():
    eng = radixserve.Engine(dtype="float32")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def alone(engine) -> dict[str, list[int]]:
    return {p: engine.generate(p, GREEDY)["output_ids"] for p in (A, B)}


def _clean(engine) -> None:
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    assert not engine.scheduler.has_work()


def _read(stream) -> tuple[list[int], str]:
    text, ids = "", []
    for chunk in stream:
        text += chunk["text"]
        ids = chunk["output_ids"]
    return ids, text


def test_a_suspended_stream_keeps_its_tokens_while_generate_runs(engine, alone) -> None:
    stream = engine.generate_stream(A, GREEDY)
    first = next(stream)
    other = engine.generate(B, GREEDY)
    ids, text = _read(stream)
    assert other["output_ids"] == alone[B]
    assert ids == alone[A] and first["text"] + text == engine.tokenizer.decode(alone[A])
    _clean(engine)


def test_interleaved_streams_each_get_their_own_tokens(engine, alone) -> None:
    a, b = engine.generate_stream(A, GREEDY), engine.generate_stream(B, GREEDY)
    got = {A: [], B: []}
    for chunk_a, chunk_b in zip(a, b):  # zip stops at the shorter one: read the rest
        got[A], got[B] = chunk_a["output_ids"], chunk_b["output_ids"]
    for prompt, stream in ((A, a), (B, b)):
        ids, _ = _read(stream)
        got[prompt] = ids or got[prompt]
    assert got == alone
    _clean(engine)


def test_a_stream_left_open_does_not_hold_up_generate(engine, alone) -> None:
    """The abandoned stream's request runs along while others drive the scheduler, but a
    generate returns when its own request is done, and closing the stream frees it."""
    stream = engine.generate_stream(A, {**GREEDY, "max_new_tokens": 400})
    next(stream)
    assert engine.generate(B, GREEDY)["output_ids"] == alone[B]
    assert engine.scheduler.has_work()  # the stream's request is still there
    stream.close()
    _clean(engine)


def test_two_threads_share_the_engine(engine, alone) -> None:
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def run(prompt: str) -> None:
        try:
            for _ in range(3):
                out = engine.generate(prompt, GREEDY)["output_ids"]
                assert out == alone[prompt], (prompt, out)
                results[prompt] = out
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in (A, B)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and results == alone
    _clean(engine)


def test_token_ids_from_numpy_and_torch(engine, alone) -> None:
    ids = engine.tokenizer.encode(B)
    for given in (np.array(ids), torch.tensor(ids), [np.int64(t) for t in ids]):
        assert engine.generate(input_ids=given, sampling_params=GREEDY)["output_ids"] \
            == alone[B]
    batch = engine.generate(input_ids=np.array([ids, ids]), sampling_params=GREEDY)
    assert [out["output_ids"] for out in batch] == [alone[B]] * 2


@pytest.mark.parametrize("kwargs,message", [
    ({"prompt": 123}, "prompt must be a string"),
    ({"prompt": ["a", None]}, "prompt must be a string"),
    ({"input_ids": "hello"}, "input_ids must be a list"),
    ({"input_ids": [1.0, 2.0]}, "token ids must be integers"),
    ({"input_ids": [True, 2]}, "token ids must be integers"),
    ({"prompt": "a", "sampling_params": "greedy"}, "sampling_params must be"),
])
def test_odd_inputs_are_clear_errors(engine, kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate(**kwargs)
    _clean(engine)


def test_use_after_shutdown_is_a_clear_error() -> None:
    eng = radixserve.Engine(dtype="float32", max_total_tokens=4096)
    stream = eng.generate_stream(A, GREEDY)
    next(stream)
    eng.shutdown()
    for call in (lambda: eng.generate(A, GREEDY), lambda: eng.get_internal_state(),
                 lambda: eng.abort("x"), lambda: next(stream)):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    eng.shutdown()  # twice is fine


@pytest.mark.parametrize("args,flag", [
    ({"max_running_requests": 0}, "max-running-requests"),
    ({"context_length": -1}, "context-length"),
    ({"mem_fraction_static": 5.0}, "mem-fraction-static"),
    ({"port": 70000}, "port"),
])
def test_bad_sizes_are_refused_before_anything_is_built(args: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        radixserve.Engine(**args)


def test_chat_renders_the_template_as_the_server_does(engine) -> None:
    """Engine.chat = generate over the template's ids (no special tokens added: the template
    writes them), one conversation or several, with the template's own options."""
    turns = [{"role": "user", "content": "What is the capital of France?"}]
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        turns, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    expected = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert engine.chat(turns, GREEDY)["output_ids"] == expected["output_ids"]
    both = engine.chat([turns, turns], GREEDY)
    assert [out["output_ids"] for out in both] == [expected["output_ids"]] * 2
    partial = turns + [{"role": "assistant", "content": "The capital is"}]
    cont = engine.chat(partial, GREEDY, add_generation_prompt=False,
                       continue_final_message=True)
    assert cont["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(partial, tokenize=False,
                                             continue_final_message=True),
        add_special_tokens=False))
    for bad in ([], [[]], "hi"):
        with pytest.raises(InvalidRequestError, match="messages must be"):
            engine.chat(bad, GREEDY)
    with pytest.raises(InvalidRequestError, match="chat template rejected"):
        engine.chat(turns, GREEDY, add_generation_prompt=True, continue_final_message=True)
    _clean(engine)
