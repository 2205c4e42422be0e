"""POST /v1/responses (OpenAI's Responses API) through the real `openai` SDK against the shared
server (bundled SmolLM2-135M, CPU, --reasoning-parser qwen3): its answers are the chat route's
for the same conversation (greedy), whole or streamed as OpenAI's event sequence; forced
function calls come back as function_call items (and stream their arguments), function
call outputs go back in as tool turns, text.format constrains the text, the reasoning of a
continued <think> block is a reasoning item, stored responses continue by
previous_response_id (and are read and deleted by id), and what the server does not do is a
400 naming the field."""
from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.test_openai_e2e import CHAT
from tests.server.test_structured_output_e2e import SCHEMAS, WEATHER

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}
QUESTION = "What is the weather like in Paris today?"


def _chat_text(client: Any, model: str, messages: list[dict], max_tokens: int) -> Any:
    """The chat route's greedy answer, asked twice: the second takes its prompt from the
    radix cache, as a request after it does (a cold prefill's rounding can differ from a
    cached prefix's and flip a greedy token)."""
    args = dict(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
    client.chat.completions.create(**args)
    return client.chat.completions.create(**args)


def test_text_answers_equal_the_chat_routes(openai_client: Any, model_name: str) -> None:
    chat = _chat_text(openai_client, model_name, CHAT, 12)
    response = openai_client.responses.create(
        model=model_name, instructions=CHAT[0]["content"], max_output_tokens=12,
        temperature=0, input=[{"role": "user", "content": [
            {"type": "input_text", "text": CHAT[1]["content"]}]}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert [item.type for item in response.output] == ["message"]
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected
    if expected == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    # a plain string input is one user turn
    chat = _chat_text(openai_client, model_name, CHAT[1:], 8)
    plain = openai_client.responses.create(model=model_name, input=CHAT[1]["content"],
                                           max_output_tokens=8, temperature=0)
    assert plain.output_text == chat.choices[0].message.content


def test_a_stream_sends_openais_events_and_the_same_answer(openai_client: Any,
                                                           model_name: str) -> None:
    args = dict(model=model_name, input=CHAT[1]["content"], instructions=CHAT[0]["content"],
                max_output_tokens=12, temperature=0)
    openai_client.responses.create(**args)  # its prompt cached for both below
    whole = openai_client.responses.create(**args)
    events = list(openai_client.responses.create(stream=True, **args))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_output_text_logprobs_are_the_chat_routes(openai_client: Any, model_name: str) -> None:
    """include ["message.output_text.logprobs"] with top_logprobs: each output_text part
    carries its tokens' logprobs, as the chat route reports them, whole or streamed."""
    args = dict(model=model_name, input=CHAT[1]["content"], max_output_tokens=6,
                temperature=0, top_logprobs=2, include=["message.output_text.logprobs"])
    openai_client.responses.create(**args)  # its prompt cached for all below
    whole = openai_client.responses.create(**args)
    chat = openai_client.chat.completions.create(
        model=model_name, messages=CHAT[1:], max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2).choices[0].logprobs.content
    got = whole.output[0].content[0].logprobs
    assert [(e.token, len(e.top_logprobs)) for e in got] == \
        [(e.token, len(e.top_logprobs)) for e in chat]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(got, chat))
    events = list(openai_client.responses.create(stream=True, **args))
    streamed = [entry for e in events if e.type == "response.output_text.delta"
                for entry in e.logprobs]
    assert [e.token for e in streamed] == [e.token for e in got]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_function_calls_are_function_call_items(openai_client: Any, model_name: str,
                                                       stream: bool) -> None:
    args = dict(model=model_name, input=QUESTION, tools=[FLAT_WEATHER], tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    if not stream:
        output = openai_client.responses.create(**args).output
    else:
        events = list(openai_client.responses.create(stream=True, **args))
        output = events[-1].response.output
        deltas = "".join(e.delta for e in events
                         if e.type == "response.function_call_arguments.delta")
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and done[0].arguments == deltas == output[-1].arguments
    calls = [item for item in output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    named = openai_client.responses.create(**{**args, "tool_choice": {
        "type": "function", "name": "get_weather"}}).output
    assert [item.name for item in named if item.type == "function_call"] == ["get_weather"]


def test_function_call_outputs_go_back_as_tool_turns(openai_client: Any,
                                                     model_name: str) -> None:
    arguments = '{"city": "Paris", "unit": "celsius"}'
    history = [{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": arguments},
               {"type": "function_call_output", "call_id": "call_1",
                "output": "21 degrees and sunny"}]
    for _ in range(2):  # the second of each takes its prompt from the cache
        response = openai_client.responses.create(model=model_name, input=history,
                                                  tools=[FLAT_WEATHER], max_output_tokens=16,
                                                  temperature=0)
    chat = openai_client.chat.completions.create(
        model=model_name, tools=[WEATHER], max_tokens=16, temperature=0, messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens > 100
    assert response.output_text == (chat.choices[0].message.content or "")


def test_text_format_json_schema_constrains_the_answer(openai_client: Any,
                                                       model_name: str) -> None:
    response = openai_client.responses.create(
        model=model_name, input="Give an example as JSON.", max_output_tokens=80,
        temperature=0, text={"format": {"type": "json_schema", "name": "nested",
                                        "schema": SCHEMAS["nested"]}})
    jsonschema.validate(json.loads(response.output_text), SCHEMAS["nested"])


def test_a_continued_think_block_is_a_reasoning_item(openai_client: Any,
                                                     model_name: str) -> None:
    turns = CHAT + [{"role": "assistant", "content": "<think>\nThe user asks about"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    openai_client.chat.completions.create(model=model_name, messages=turns, max_tokens=8,
                                          temperature=0, extra_body=cont)  # cached for both
    chat = openai_client.chat.completions.create(model=model_name, messages=turns,
                                                 max_tokens=8, temperature=0,
                                                 extra_body=cont).choices[0].message
    response = openai_client.responses.create(model=model_name, input=turns,
                                              max_output_tokens=8, temperature=0,
                                              extra_body=cont)
    reasoning = [item for item in response.output if item.type == "reasoning"]
    assert len(reasoning) == 1 and reasoning[0].content[0].text == chat.reasoning_content
    assert response.usage.output_tokens_details.reasoning_tokens > 0


@pytest.mark.parametrize("extra,param", [
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"modalities": ["text"]}, "modalities"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}},
     "text.format"),
])
def test_what_the_server_does_not_do_is_a_400_naming_it(openai_client: Any, model_name: str,
                                                        extra: dict, param: str) -> None:
    body = {"model": model_name, "input": "Hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.post("/responses", body=body, cast_to=object)
    assert info.value.body["param"] == param, info.value.body


def test_a_stream_refused_before_its_first_output_keeps_its_status_and_later_errors_are_events(
        ) -> None:
    """No event goes out before the first output: a refusal then (a full queue) propagates as
    the route's HTTP error; an error after it ends the stream with `error` and
    `response.failed`."""
    import asyncio
    from types import SimpleNamespace

    from radixserve.server.errors import APIError
    from radixserve.server.openai_responses import ResponseShape, stream_response
    from radixserve.server.request_state import ReqOutput

    class Manager:
        tokenizer = None

        def __init__(self, outputs: int) -> None:
            self.outputs = outputs

        async def generate_merged(self, reqs: list, request: Any):
            for i in range(self.outputs):
                yield 0, ReqOutput("r", "ab"[:i + 1], [1] * (i + 1), {}, False)
            raise APIError("the waiting queue is full", status_code=429)

    def run(outputs: int) -> list[bytes]:
        ctx = SimpleNamespace(tokenizer_manager=Manager(outputs))
        plan = SimpleNamespace(parse_output=False, parser=None, max_calls=None)

        async def collect() -> list[bytes]:
            chat = SimpleNamespace(logprobs=False)
            return [chunk async for chunk in stream_response(
                ctx, ResponseShape({}, "m"), chat, plan, None, [], None)]
        return asyncio.run(collect())

    with pytest.raises(APIError, match="queue is full"):
        run(0)
    kinds = [json.loads(chunk.split(b"data: ", 1)[1])["type"] for chunk in run(2)]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-2:] == ["error", "response.failed"]


def test_previous_response_id_continues_the_stored_conversation(openai_client: Any,
                                                                model_name: str) -> None:
    """A second turn by previous_response_id is the chat route's answer to the whole
    conversation (the first input, the first answer, the new input); stored responses are
    read and deleted by id; store false keeps nothing; an unknown id is a 404."""
    args = dict(model=model_name, max_output_tokens=8, temperature=0)
    first = openai_client.responses.create(input=CHAT[1]["content"], **args)
    turns = [CHAT[1], {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And two more?"}]
    chat = _chat_text(openai_client, model_name, turns, 8)
    second = openai_client.responses.create(input="And two more?",
                                            previous_response_id=first.id, **args)
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert openai_client.responses.retrieve(first.id).output_text == first.output_text
    openai_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        openai_client.responses.create(input="Hi", previous_response_id=first.id, **args)
    unkept = openai_client.responses.create(input="Hi", store=False, **args)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unkept.id)


def test_the_store_keeps_the_newest_responses_and_their_answers_as_turns() -> None:
    from radixserve.server.responses_store import ResponseStore, assistant_turn
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put({"id": f"r{i}", "output": []}, [{"role": "user", "content": str(i)}])
    assert store.response("r0") is None and store.conversation("r2")[0]["content"] == "2"
    output = [{"type": "reasoning", "content": []},
              {"type": "message", "content": [{"type": "output_text", "text": "Hi"}]},
              {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]
    assert assistant_turn(output) == {"role": "assistant", "content": "Hi", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
