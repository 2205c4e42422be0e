"""Request validation of the OpenAI protocol models (no server needed)."""
from __future__ import annotations

import json

from typing import Any

import pytest

from radixserve.server.errors import APIError
from radixserve.server.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                               parse_model)


def completion(**fields: Any) -> CompletionRequest:
    body = parse_model(CompletionRequest, {"prompt": "hi", **fields})
    body.check_unsupported()
    return body


def chat(**fields: Any) -> ChatCompletionRequest:
    body = parse_model(ChatCompletionRequest,
                       {"messages": [{"role": "user", "content": "hi"}], **fields})
    body.check_unsupported()
    return body


def test_sampling_params_mapping() -> None:
    body = completion(temperature=0.5, top_p=0.9, stop=["\n"], seed=3, n=2, top_k=5,
                      min_tokens=2, frequency_penalty=0.1, ignore_eos=True)
    params = body.sampling_params(max_new_tokens=7)
    params.verify()
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.5,
                                                                                       0.9, 5)
    assert params.stop == ["\n"] and params.seed == 3 and params.min_new_tokens == 2
    assert params.frequency_penalty == 0.1 and params.ignore_eos
    assert params.n == 1, "n is expanded by the server, each sample has n=1"


def test_unset_fields_keep_sampling_defaults() -> None:
    params = completion().sampling_params(max_new_tokens=4)
    from radixserve.core.sampling_params import SamplingParams

    default = SamplingParams(max_new_tokens=4)
    assert (params.temperature, params.top_p, params.top_k) == (default.temperature,
                                                                default.top_p, default.top_k)


def test_null_fields_take_their_defaults() -> None:
    """OpenAI documents n, stream, echo, logprobs, ... as "or null" and the openai client
    sends null for an option passed as None: null is the field's default, not a 400."""
    nulls = dict.fromkeys(("n", "stream", "echo", "ignore_eos", "skip_special_tokens",
                           "logprobs", "max_tokens", "stream_options"))
    body = completion(**nulls)
    assert (body.n, body.stream, body.echo, body.ignore_eos, body.skip_special_tokens) == \
        (1, False, False, False, True)
    body = chat(**dict.fromkeys(("n", "stream", "logprobs", "max_completion_tokens",
                                 "add_generation_prompt", "parallel_tool_calls")))
    assert (body.n, body.stream, body.logprobs, body.add_generation_prompt) == \
        (1, False, False, True)
    assert chat(stream=True, stream_options={"include_usage": None}).stream_options \
        .include_usage is False
    with pytest.raises(APIError):  # a required field stays required
        parse_model(CompletionRequest, {"prompt": None})


@pytest.mark.parametrize("prompt,expected", [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt: Any, expected: Any) -> None:
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"stream": 1}, "stream"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"bogus": 1}, "bogus"),
])
def test_completion_rejections(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        completion(**fields)
    assert info.value.status_code == 400
    assert info.value.param == param
    assert set(info.value.to_json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("fields,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "messages"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_json": {"type": "object"}, "regex": "a"}, "guided_json"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_chat_rejections(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        chat(**fields)
    assert info.value.status_code == 400 and info.value.param == param


def test_a_returned_assistant_message_can_be_sent_back() -> None:
    """The agent loop appends the response's message (the SDK's model_dump() of it, with
    OpenAI's null fields, and this server's reasoning_content) to the history: accepted, the
    reasoning passed to the template (as reasoning_content, and as gpt-oss's thinking)."""
    returned = {"role": "assistant", "content": None, "refusal": None, "annotations": [],
                "audio": None, "function_call": None, "reasoning_content": "Look it up.",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "f", "arguments": "{}"}}]}
    body = chat(messages=[{"role": "user", "content": "q"}, returned,
                          {"role": "tool", "tool_call_id": "call_1", "content": "42"}])
    message = body.conversation()[1]
    assert message["reasoning_content"] == message["thinking"] == "Look it up."
    # beside content and tool calls, no `thinking` (gpt-oss's template refuses all three)
    body = chat(messages=[{"role": "user", "content": "q"}, {**returned, "content": "One sec."},
                          {"role": "tool", "tool_call_id": "call_1", "content": "42"}])
    assert "thinking" not in body.conversation()[1]
    with pytest.raises(APIError):  # a refusal is the model's, never the history's
        chat(messages=[{"role": "user", "content": "q"}, {**returned, "refusal": "no"}])


def test_chat_content_parts_and_developer_role() -> None:
    body = chat(messages=[{"role": "developer", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}],
                max_completion_tokens=9)
    assert body.conversation() == [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "ab"}]
    assert body.requested_max_tokens == 9
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                          "image_url": {"url": "x"}}]}])
    with pytest.raises(APIError):
        image.conversation()


def test_completion_top_logprobs_always_list_the_chosen_token() -> None:
    # OpenAI's legacy logprobs: up to logprobs + 1 entries, the sampled token always among them
    from radixserve.server.openai_completions import LogprobBuilder

    tokens = [(-2.5, 7, " sampled"), (-0.1, 3, " top"), (None, 1, "first")]
    tops = [[(-0.2, 3, " top")], [(-0.1, 3, " top")], None]
    built = LogprobBuilder(start_offset=4).build(tokens, tops)
    assert built["top_logprobs"] == [{" top": -0.2, " sampled": -2.5}, {" top": -0.1}, None]
    assert built["tokens"] == [" sampled", " top", "first"]
    assert built["text_offset"] == [4, 12, 16]


def test_vllm_guided_fields_are_the_same_grammars() -> None:
    """guided_json (a schema object or its text), guided_regex, guided_grammar (EBNF) and
    guided_choice (an EBNF whose sentences are the choices, quotes escaped) become the
    sampling parameters /generate takes, and errors about them name the guided field."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat(guided_json=schema).grammar() == {"json_schema": json.dumps(schema)}
    assert chat(guided_json='{"type": "string"}').grammar() == {
        "json_schema": '{"type": "string"}'}
    assert completion(guided_regex="[0-9]+").grammar() == {"regex": "[0-9]+"}
    assert completion(guided_grammar='root ::= "x"').grammar() == {"ebnf": 'root ::= "x"'}
    body = chat(guided_choice=["yes", 'say "no"'])
    assert body.grammar() == {"ebnf": 'root ::= "yes" | "say \\"no\\""'}
    assert body.grammar_field() == "guided_choice" and chat().grammar_field() is None
