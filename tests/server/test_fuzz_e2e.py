"""Fuzzing every generation route of the real server with random and adversarial JSON
(hypothesis): wrong types, huge numbers, lone surrogates, deep nesting, huge strings, unknown
fields. No answer is a 5xx, the server serves a normal request afterwards, and its memory check
passes once idle. Generation lengths stay small so the valid cases cost little."""
from __future__ import annotations

import json
from typing import Any

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
EXAMPLES = 200

adversarial_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "Hi \ud800", "\udfff", "\x00", "a" * 100_000, "🙂" * 50]),
)
leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), adversarial_text,
)
junk = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                  st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4)),
                    max_leaves=12)
small_count = st.one_of(st.integers(min_value=-3, max_value=3), junk)
token_ids = st.one_of(st.lists(st.integers(min_value=-5, max_value=60_000), max_size=8),
                      st.lists(st.lists(st.integers(min_value=0, max_value=100), max_size=4),
                               max_size=3), junk)


def _fields(required: dict[str, Any], optional: dict[str, Any]) -> Any:
    return st.fixed_dictionaries(required, optional=optional).flatmap(
        lambda body: st.dictionaries(st.text(max_size=10), junk, max_size=2).map(
            lambda extra: {**extra, **body}))


sampling = st.one_of(junk, st.fixed_dictionaries({}, optional={
    "max_new_tokens": small_count, "temperature": leaf, "top_p": leaf, "top_k": leaf,
    "n": small_count, "stop": st.one_of(adversarial_text, junk), "seed": leaf,
    "frequency_penalty": leaf, "unknown": junk}))
GENERATE = _fields({}, {"text": st.one_of(adversarial_text, st.lists(adversarial_text, max_size=3),
                                          junk),
                        "input_ids": token_ids, "sampling_params": sampling, "rid": junk,
                        "return_logprob": junk, "top_logprobs_num": small_count,
                        "logprob_start_len": small_count, "stream": junk})
COMPLETIONS = _fields({"max_tokens": small_count},
                      {"prompt": st.one_of(adversarial_text, token_ids, junk), "model": junk,
                       "n": small_count, "temperature": leaf, "stop": junk, "echo": junk,
                       "logprobs": small_count, "stream": junk, "seed": leaf,
                       "stream_options": junk, "best_of": junk})
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system",
                                                                     "assistant"]), junk),
                                 "content": st.one_of(adversarial_text, junk)})
CHAT = _fields({"max_tokens": small_count},
               {"messages": st.one_of(st.lists(message, max_size=3), junk), "model": junk,
                "n": small_count, "temperature": leaf, "top_logprobs": small_count,
                "logprobs": junk, "stream": junk, "tools": junk, "response_format": junk})
RAW = st.one_of(st.binary(max_size=64), st.just(b"[" * 50_000),
                st.just(b'{"text": "' + b"\\ud800" * 3 + b'"}'))


def _post(server: Any, path: str, body: bytes) -> requests.Response:
    return requests.post(server.url(path), data=body, headers=AUTH, timeout=300)


def _check(server: Any, path: str, body: Any) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8", "surrogatepass")
    response = _post(server, path, raw)
    assert response.status_code < 500, (path, raw[:300], response.text[:300])


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@FUZZ
@given(body=GENERATE)
def test_fuzz_generate(server: Any, body: dict) -> None:
    if "sampling_params" not in body:  # else a valid body generates the default 128 tokens
        body = {**body, "sampling_params": {"max_new_tokens": 4}}
    _check(server, "/generate", body)


@FUZZ
@given(body=COMPLETIONS)
def test_fuzz_completions(server: Any, body: dict) -> None:
    _check(server, "/v1/completions", body)


@FUZZ
@given(body=CHAT)
def test_fuzz_chat(server: Any, body: dict) -> None:
    _check(server, "/v1/chat/completions", body)


@FUZZ
@given(body=RAW, path=st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions",
                                       "/abort_request", "/flush_cache"]))
def test_fuzz_raw_bodies(server: Any, body: bytes, path: str) -> None:
    _check(server, path, body)


def test_server_is_fine_after_fuzzing(server: Any) -> None:
    ok = requests.post(server.url("/v1/completions"), headers=AUTH, timeout=300, json={
        "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200
    info = server.wait_idle_memory_check()
    assert info["internal_state"]["memory_check_ok"] is True
