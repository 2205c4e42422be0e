"""Constrained decoding and tool calling through the real server and the real `openai` SDK
(bundled SmolLM2-135M, CPU): JSON-schema outputs validate (jsonschema), regex outputs fully
match, EBNF works, forced tool calls parse and validate (one, or several with
parallel_tool_calls), streaming and not, n = 3; masking
leaves unconstrained requests in the same batch unchanged; bad grammars are 400s naming the
field; the KV accounting is intact afterwards."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.test_native_e2e import post, sse_events

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "array_enum": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 3},
        "mood": {"type": "string", "enum": ["happy", "sad"]}},
        "required": ["colors", "mood"]},
    "bounded_numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["age", "score"]},
    "optional_fields": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 16},
        "draft": {"type": "boolean"},
        "pages": {"type": "integer", "minimum": 1, "maximum": 500}},
        "required": ["title"]},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _schema_format(name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def _chat_json(client: Any, model: str, name: str, stream: bool) -> list[str]:
    kwargs = dict(model=model, n=3, max_tokens=80, temperature=0.8, seed=7,
                  response_format=_schema_format(name),
                  messages=[{"role": "user", "content": f"Give an example {name} as JSON."}])
    if not stream:
        return [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    texts = [""] * 3
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    return texts


# the streamed forms of the next cases run with --run-slow (3-5 s each): streamed constrained
# output stays in CI through test_forced_tool_call_streamed
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["whole", "streamed"])
def test_json_schema_outputs_validate(openai_client: Any, model_name: str, stream: bool) -> None:
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # concurrent: one batch on the server
        results = dict(zip(SCHEMAS, pool.map(
            lambda name: _chat_json(openai_client, model_name, name, stream), SCHEMAS)))
    for name, texts in results.items():
        assert len(texts) == 3
        for text in texts:
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_on_completions(openai_client: Any, model_name: str) -> None:
    out = openai_client.completions.create(
        model=model_name, prompt="A person described as a JSON object:", max_tokens=60,
        temperature=0, extra_body={"response_format": {"type": "json_object"},
                                   "stop_token_ids": []})
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert choice.text.lstrip().startswith("{")


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["whole", "streamed"])
def test_vllm_guided_fields(openai_client: Any, model_name: str, stream: bool) -> None:
    """vLLM's guided_choice / guided_json / guided_regex through the SDK's extra_body."""
    choices = ["sunny", "rainy", "a \"grey\" day"]
    schema = SCHEMAS["nested"]
    asks = [({"guided_choice": choices}, lambda text: text in choices),
            ({"guided_json": schema}, lambda text: jsonschema.validate(json.loads(text), schema)
             is None),
            ({"guided_regex": r"[A-Z][a-z]{2,8}"},
             lambda text: re.fullmatch(r"[A-Z][a-z]{2,8}", text) is not None)]
    for extra, valid in asks:
        kwargs = {"model": model_name, "messages": ASK_WEATHER, "max_tokens": 80,
                  "temperature": 0, "extra_body": extra}
        if stream:
            text = "".join(chunk.choices[0].delta.content or "" for chunk in
                           openai_client.chat.completions.create(stream=True, **kwargs)
                           if chunk.choices)
        else:
            text = openai_client.chat.completions.create(**kwargs).choices[0].message.content
        assert valid(text), (extra, text)


def test_regex_and_ebnf_native(server: Any) -> None:
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    out = post(server, "/generate", {"text": "Call me at", "sampling_params": {
        "max_new_tokens": 20, "temperature": 0.9, "n": 2, "regex": phone}}).json()
    for item in out:
        assert re.fullmatch(phone, item["text"]), item["text"]
    events = sse_events(post(server, "/generate", {
        "text": "Is the sky blue? Answer:", "stream": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                            "ebnf": 'root ::= "yes" | "no" | "maybe, " [a-z]+'}}, stream=True))
    assert events[-1] == "[DONE]"
    text = events[-2]["text"]
    assert re.fullmatch(r"yes|no|maybe, [a-z]+", text) or \
        events[-2]["meta_info"]["finish_reason"]["type"] == "length"


def test_masking_leaves_unconstrained_requests_unchanged(server: Any) -> None:
    plain = {"max_new_tokens": 12, "temperature": 0}
    prompts = ["Once upon a time", "The capital of France is"]
    alone = [post(server, "/generate", {"text": p, "sampling_params": plain}).json()
             for p in prompts]
    mixed = post(server, "/generate", {
        "text": [prompts[0], "Pick a number:", prompts[1], "A city:"],
        "sampling_params": [plain, {**plain, "regex": r"[0-9]{2,5}"}, plain,
                            {**plain, "json_schema": json.dumps(SCHEMAS["nested"])}]}).json()
    assert mixed[0]["output_ids"] == alone[0]["output_ids"]
    assert mixed[2]["output_ids"] == alone[1]["output_ids"]
    assert re.fullmatch(r"[0-9]{2,5}", mixed[1]["text"])


def _check_call(call: Any) -> None:
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("tool_choice,parallel", [
    ("required", False), ({"type": "function", "function": {"name": "get_weather"}}, None)],
    ids=["required-not-parallel", "named"])
def test_forced_tool_call(openai_client: Any, model_name: str, tool_choice: Any,
                          parallel: bool | None) -> None:
    """Exactly one call: required with parallel_tool_calls false, or a named function."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    out = openai_client.chat.completions.create(
        model=model_name, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=tool_choice,
        max_tokens=60, temperature=0, **extra)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["whole", "streamed"])
def test_forced_parallel_tool_calls(openai_client: Any, model_name: str, stream: bool) -> None:
    """tool_choice required with parallel_tool_calls absent (true): the grammar allows one or
    more calls; min_tokens keeps EOS out until past the first call, so the grammar's only way
    on is a second <tool_call> block, and every complete call parses and validates."""
    kwargs = dict(model=model_name, messages=[{"role": "user", "content": (
        "What is the weather like in Paris and in Rome today?")}], tools=[WEATHER],
        tool_choice="required", max_tokens=120, temperature=0, extra_body={"min_tokens": 40})
    if not stream:
        choice = openai_client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert len(calls) >= 2 and len({c.id for c in calls}) == len(calls)
        for call in calls:
            _check_call(call)
        return
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index == len(calls) and delta.function.name == "get_weather"
                calls[delta.index] = {"id": delta.id, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls" and len(calls) >= 2
    complete = [c for c in calls.values() if _parses(c["arguments"])]
    assert len(complete) >= 2  # a last call cut by max_tokens may be unfinished
    for call in complete:
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("max_tokens", [pytest.param(50, marks=pytest.mark.slow), 60],
                         ids=["after-a-call", "inside-a-call"])
def test_tool_calls_cut_by_max_tokens_finish_with_length(openai_client: Any, model_name: str,
                                                         max_tokens: int) -> None:
    """The forced parallel answer of the test above, cut after its first call (50 tokens) or
    inside the second's arguments (60): the first call is there, finish_reason is "length"
    (as OpenAI answers), and the whole answer holds the calls a stream of it sent, the cut
    one with its arguments as far as they got."""
    kwargs = dict(model=model_name, messages=[{"role": "user", "content": (
        "What is the weather like in Paris and in Rome today?")}], tools=[WEATHER],
        tool_choice="required", max_tokens=max_tokens, temperature=0,
        extra_body={"min_tokens": 40})
    choice = openai_client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.tool_calls, "the first call fits in 50 tokens"
    _check_call(choice.message.tool_calls[0])
    assert choice.finish_reason == "length"
    reasons = []
    streamed: dict[int, list[str]] = {}  # index -> [name, arguments]
    for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
        reasons.append(chunk.choices[0].finish_reason)
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                streamed[delta.index] = [delta.function.name, ""]
            streamed[delta.index][1] += delta.function.arguments or ""
    assert reasons[-1] == "length"
    # whole and streamed answers hold the same calls, the one max_tokens cut included
    whole = [[c.function.name, c.function.arguments] for c in choice.message.tool_calls]
    assert whole == [streamed[i] for i in sorted(streamed)]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def test_forced_tool_call_streamed(openai_client: Any, model_name: str) -> None:
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in openai_client.chat.completions.create(
            model=model_name, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, max_tokens=60, temperature=0, stream=True):
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # the first delta of a call names it
                assert delta.index not in calls and delta.function.name == "get_weather"
                calls[delta.index] = {"id": delta.id, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls" and list(calls) == [0]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_multi_turn_tool_conversation(openai_client: Any, model_name: str) -> None:
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    out = openai_client.chat.completions.create(model=model_name, messages=history,
                                                tools=[WEATHER], max_tokens=16, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > 100  # the tools' system prompt and every turn


@pytest.mark.parametrize("kwargs,param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"extra_body": {"regex": "[a-"}}, "regex"),
    ({"extra_body": {"ebnf": "root ::= "}}, "ebnf"),
    ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
    ({"extra_body": {"guided_json": {"type": "objec"}}}, "guided_json"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
], ids=["schema", "format-type", "regex", "ebnf", "guided-regex", "guided-json", "unknown-tool",
        "tool-name"])
def test_bad_grammar_is_400_naming_it(openai_client: Any, model_name: str,
                                      kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=model_name, messages=ASK_WEATHER,
                                              max_tokens=4, **kwargs)
    assert info.value.body["param"] == param
    # the message names the field the client sent, and not xgrammar's failed assertion
    message = info.value.body["message"]
    assert param.split(".")[0] in message and "Check failed" not in message, message


def test_bad_native_grammar_is_400(server: Any) -> None:
    for params, name in [({"json_schema": '{"type": "objec"}'}, "json_schema"),
                         ({"regex": "(unclosed"}, "regex"),
                         ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf")]:
        response = post(server, "/generate", {"text": "x", "sampling_params": params})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == name and name in error["message"]


def test_memory_accounting_after_constrained_requests(server: Any) -> None:
    state = server.server_info()["internal_state"]
    assert state["memory_check_ok"] in (True, None)
    assert state["leaked_tokens"] == 0
