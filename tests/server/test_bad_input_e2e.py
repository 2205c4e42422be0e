"""Bad requests get the documented 4xx (radixserve/server/errors.py) in OpenAI's error shape;
never a 5xx; the server stays healthy."""
from __future__ import annotations

import re
from typing import Any

import pytest
import requests

from tests.server.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT_MSG = [{"role": "user", "content": "hi"}]

# (name, method, path, json body or raw bytes, headers, expected status)
CASES: list[tuple[str, str, str, Any, dict[str, str], int]] = [
    ("malformed json completions", "POST", "/v1/completions", b"{not json", AUTH, 400),
    ("malformed json generate", "POST", "/generate", b'{"text": "a",', AUTH, 400),
    ("malformed json chat", "POST", "/v1/chat/completions", b"\xff\xfe", AUTH, 400),
    ("body not an object", "POST", "/v1/completions", [1, 2], AUTH, 400),
    ("prompt wrong type", "POST", "/v1/completions", {"prompt": 123}, AUTH, 400),
    ("missing prompt", "POST", "/v1/completions", {"max_tokens": 3}, AUTH, 400),
    ("max_tokens as string", "POST", "/v1/completions", {"prompt": "a", "max_tokens": "5"},
     AUTH, 400),
    ("stream wrong type", "POST", "/v1/completions", {"prompt": "a", "stream": "yes"}, AUTH, 400),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, AUTH, 400),
    ("empty prompt list", "POST", "/v1/completions", {"prompt": []}, AUTH, 400),
    ("empty chat messages", "POST", "/v1/chat/completions", {"messages": []}, AUTH, 400),
    ("bad chat role", "POST", "/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "x"}]}, AUTH, 400),
    ("negative max_tokens", "POST", "/v1/completions", {"prompt": "a", "max_tokens": -1},
     AUTH, 400),
    ("huge max_tokens", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 10**9},
     AUTH, 400),
    ("huge max_completion_tokens", "POST", "/v1/chat/completions",
     {"messages": CHAT_MSG, "max_completion_tokens": 10**9}, AUTH, 400),
    ("n = 0", "POST", "/v1/completions", {"prompt": "a", "n": 0}, AUTH, 400),
    # a chat answer has at least one token (an empty 200 came back), as vLLM and OpenAI say
    ("chat max_tokens 0", "POST", "/v1/chat/completions", {"messages": CHAT_MSG,
                                                           "max_tokens": 0}, AUTH, 400),
    ("chat max_completion_tokens 0", "POST", "/v1/chat/completions",
     {"messages": CHAT_MSG, "max_completion_tokens": 0}, AUTH, 400),
    # past float32, the penalty turned a zero logit into NaN
    ("repetition_penalty past float32", "POST", "/v1/completions",
     {"prompt": "a", "repetition_penalty": 1e39}, AUTH, 400),
    # a seed past 64 bits was taken modulo 2^64 (2^64 + 5 sampled as 5)
    ("seed past 64 bits", "POST", "/v1/completions", {"prompt": "a", "seed": 2**64 + 5},
     AUTH, 400),
    ("temperature < 0", "POST", "/v1/chat/completions",
     {"messages": CHAT_MSG, "temperature": -0.5}, AUTH, 400),
    ("top_p = 0", "POST", "/v1/completions", {"prompt": "a", "top_p": 0}, AUTH, 400),
    ("logprobs too many", "POST", "/v1/completions", {"prompt": "a", "logprobs": 50}, AUTH, 400),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions",
     {"messages": CHAT_MSG, "top_logprobs": 2}, AUTH, 400),
    ("unsupported field", "POST", "/v1/completions", {"prompt": "a", "frobnicate": 1}, AUTH, 400),
    ("unsupported tools", "POST", "/v1/chat/completions",
     {"messages": CHAT_MSG, "tools": [{"type": "function"}]}, AUTH, 400),
    ("token id out of vocabulary", "POST", "/v1/completions", {"prompt": [1, 10**7]}, AUTH, 400),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-17", "prompt": "a"}, AUTH, 404),
    ("unknown model chat", "POST", "/v1/chat/completions",
     {"model": "gpt-17", "messages": CHAT_MSG}, AUTH, 404),
    ("missing api key", "POST", "/v1/completions", {"prompt": "a"}, {}, 401),
    ("wrong api key", "POST", "/v1/completions", {"prompt": "a"},
     {"Authorization": "Bearer nope"}, 401),
    ("missing api key native", "POST", "/generate", {"text": "a"}, {}, 401),
    ("missing api key metrics", "GET", "/metrics", None, {}, 401),
    ("generate text and input_ids", "POST", "/generate", {"text": "a", "input_ids": [1]},
     AUTH, 400),
    ("generate unknown sampling param", "POST", "/generate",
     {"text": "a", "sampling_params": {"temprature": 1}}, AUTH, 400),
    ("generate negative max_new_tokens", "POST", "/generate",
     {"text": "a", "sampling_params": {"max_new_tokens": -3}}, AUTH, 400),
    ("generate empty input_ids", "POST", "/generate", {"input_ids": []}, AUTH, 400),
    ("generate batch size mismatch", "POST", "/generate",
     {"text": ["a", "b"], "rid": ["x"]}, AUTH, 400),
    ("abort without rid", "POST", "/abort_request", {}, AUTH, 400),
    # booleans the detokenizer and the stop checks use: 0 or null killed the detokenizer
    ("generate skip_special_tokens 0", "POST", "/generate",
     {"text": "a", "sampling_params": {"max_new_tokens": 2, "skip_special_tokens": 0}}, AUTH, 400),
    ("generate ignore_eos as string", "POST", "/generate",
     {"text": "a", "sampling_params": {"max_new_tokens": 2, "ignore_eos": "no"}}, AUTH, 400),
    ("generate spaces_between_special_tokens null", "POST", "/generate",
     {"text": "a", "sampling_params": {"spaces_between_special_tokens": None}}, AUTH, 400),
    ("generate infinite temperature", "POST", "/generate",
     b'{"text": "a", "sampling_params": {"temperature": Infinity}}', AUTH, 400),
    ("logit_bias superscript key", "POST", "/v1/completions",
     {"prompt": "a", "max_tokens": 2, "logit_bias": {"\u00b2": 1}}, AUTH, 400),
    ("generate logit_bias superscript key", "POST", "/generate",
     {"text": "a", "sampling_params": {"logit_bias": {"\u00b3": 1}}}, AUTH, 400),
    ("integer of 5000 digits", "POST", "/v1/completions",
     b'{"prompt": "a", "max_tokens": 1, "seed": ' + b"9" * 5000 + b"}", AUTH, 400),
    ("empty regex completions", "POST", "/v1/completions", {"prompt": "a", "regex": ""}, AUTH,
     400),
    ("lone surrogate completions", "POST", "/v1/completions",
     b'{"prompt": "Hi \\ud800", "max_tokens": 2}', AUTH, 400),
    ("lone surrogate chat", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "Hi \\ud800"}]}', AUTH, 400),
    ("lone surrogate generate", "POST", "/generate", b'{"text": "Hi \\ud800"}', AUTH, 400),
    ("deep nesting", "POST", "/v1/completions", b"[" * 100_000, AUTH, 400),
    ("deep nesting generate", "POST", "/generate",
     b'{"input_ids": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", AUTH, 400),
    ("deeply nested tool call arguments in the history", "POST", "/v1/chat/completions",
     {"messages": [CHAT_MSG[0], {"role": "assistant", "tool_calls": [
         {"id": "c1", "type": "function",
          "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
         {"role": "tool", "content": "ok", "tool_call_id": "c1"}], "max_tokens": 2}, AUTH, 400),
    ("unknown route", "GET", "/v2/nothing", None, AUTH, 404),
    ("wrong method", "GET", "/v1/completions", None, AUTH, 405),
]


def send(server: Any, method: str, path: str, body: Any,
         headers: dict[str, str]) -> requests.Response:
    kwargs: dict[str, Any] = {"headers": dict(headers), "timeout": 120}
    if isinstance(body, bytes):
        kwargs["data"] = body
        kwargs["headers"]["Content-Type"] = "application/json"
    elif body is not None:
        kwargs["json"] = body
    return requests.request(method, server.url(path), **kwargs)


@pytest.mark.parametrize("name,method,path,body,headers,status", CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input(server: Any, name: str, method: str, path: str, body: Any,
                   headers: dict[str, str], status: int) -> None:
    response = send(server, method, path, body, headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("rate_limit_error" if status == 429 else "invalid_request_error")


def test_over_context_prompt_names_both_lengths(server: Any) -> None:
    context_len = requests.get(server.url("/get_model_info"), headers=AUTH,
                               timeout=30).json()["context_len"]
    prompt = [100] * (context_len + 5)
    for path, body in (("/v1/completions", {"prompt": prompt, "max_tokens": 1}),
                       ("/generate", {"input_ids": prompt})):
        response = send(server, "POST", path, body, AUTH)
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert str(len(prompt)) in message and str(context_len) in message


def test_health_without_key_and_healthy_after(server: Any) -> None:
    assert requests.get(server.url("/health"), timeout=30).status_code == 200
    assert requests.get(server.url("/health_generate"), headers=AUTH,
                        timeout=120).status_code == 200
    info = server.wait_idle_memory_check()
    assert info["internal_state"]["memory_check_ok"] is True


def test_health_and_small_requests_answer_while_a_huge_prompt_is_tokenised(server: Any) -> None:
    """Tokenisation runs off the event loop, and a huge body in a lane of its own: /health and
    small generate requests answer while a 5 MB prompt is being tokenised (seconds on a
    2-core machine; the big request is still in flight when they return). With one lane the
    small requests would wait behind the big one."""
    import threading
    big = {"text": "hello world, " * 400_000, "sampling_params": {"max_new_tokens": 1}}
    small = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
    done = threading.Event()
    result: dict[str, Any] = {}

    def post_big() -> None:
        result["response"] = requests.post(server.url("/generate"), json=big, headers=AUTH,
                                           timeout=300)
        done.set()

    thread = threading.Thread(target=post_big)
    thread.start()
    try:
        health_during = small_during = 0
        while not done.is_set():
            health = requests.get(server.url("/health"), timeout=30)
            assert health.status_code == 200
            health_during += not done.is_set()
            reply = requests.post(server.url("/generate"), json=small, headers=AUTH,
                                  timeout=300)
            assert reply.status_code == 200
            small_during += not done.is_set()
        assert health_during > 0
        assert small_during >= 2
    finally:
        thread.join()
    assert result["response"].status_code == 400  # far past the context length
    assert "context length" in result["response"].json()["error"]["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a", "max_tokens": -5}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT_MSG, "max_tokens": 3, "min_tokens": 5},
     "min_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -5}}, "max_new_tokens"),
    # a text-only model: images are refused where they come from
    ("/generate", {"text": "a", "image_data": "data:image/png;base64,AAAA"}, "image_data"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages"),
])
def test_errors_name_the_routes_own_fields(server: Any, path: str, body: dict,
                                           param: str) -> None:
    """OpenAI's routes take max_tokens / min_tokens, /generate max_new_tokens: each error
    names the field as that route spells it, in param (and in the message where it is about
    a value)."""
    response = send(server, "POST", path, body, AUTH)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert param in error["message"] or "reads no images" in error["message"]
    other = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}.get(param)
    assert other is None or other not in error["message"]


def _http_responses(server: Any) -> dict[tuple[str, str, str], float]:
    text = requests.get(server.url("/metrics"), headers=AUTH, timeout=30).text
    assert "_created" not in text  # no creation-time series beside the counters
    counts = {}
    for line in text.splitlines():
        if line.startswith("radixserve:http_responses_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            key = tuple(labels[k] for k in ("method", "route", "status"))
            counts[key] = float(line.split()[-1])
    return counts


def test_http_responses_are_counted_by_route_and_status(server: Any) -> None:
    """/metrics counts every answer by method, route template and status: the routes' own
    (200, 400, 404 for an unknown model, 405), the middlewares' (401 without the key) and
    paths no route serves (one "unmatched" label, whatever the path)."""
    expected = {
        ("POST", "/v1/completions", "200"): ("/v1/completions",
                                             {"prompt": "a", "max_tokens": 1}, AUTH),
        ("POST", "/v1/completions", "400"): ("/v1/completions", {"prompt": ""}, AUTH),
        ("POST", "/v1/chat/completions", "404"): (
            "/v1/chat/completions", {"model": "no-such-model", "messages": CHAT_MSG}, AUTH),
        ("POST", "/generate", "401"): ("/generate", {"text": "a"}, {}),
        ("GET", "/v1/completions", "405"): ("/v1/completions", None, AUTH),
        ("GET", "unmatched", "404"): ("/v2/nothing-here", None, AUTH),
        ("GET", "/v1/models/{model_id:path}", "404"): ("/v1/models/a/b", None, AUTH),
    }
    before = _http_responses(server)
    for (method, _, status), (path, body, headers) in expected.items():
        assert send(server, method, path, body, headers).status_code == int(status)
    send(server, "GET", "/v2/another/path", None, AUTH)
    after = _http_responses(server)
    for key in expected:
        extra = 1 if key == ("GET", "unmatched", "404") else 0
        assert after.get(key, 0) - before.get(key, 0) == 1 + extra, key
    assert not any("nothing-here" in route or "another" in route for _, route, _ in after)
