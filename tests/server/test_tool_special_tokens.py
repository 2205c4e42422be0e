"""Tool-call markers that are special tokens (Mistral's [TOOL_CALLS], Llama 3.1's
<|python_tag|>): a chat request with tools keeps the marker in its text while EOS and other
special tokens stay out of the content. The bundled SmolLM2 tokenizer with the marker added
as a special token drives the real path: build_requests (the chat handler's sampling params),
Req.check_finished on EOS, the scheduler's token output, the DetokenizerManager, then the
parser on the finished text and the stream of deltas."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from radixserve.core.req import Req
from radixserve.core.sampling_params import InvalidRequestError, SamplingParams
from radixserve.scheduler.output import build_token_output
from radixserve.server.detokenizer_manager import DetokenizerManager
from radixserve.server.incremental_detokenizer import IncrementalDetokenizer
from radixserve.server.openai_chat import build_requests
from radixserve.server.openai_common import OpenAIContext
from radixserve.server.openai_protocol import ChatCompletionRequest
from radixserve.server.openai_tools import ToolPlan, tool_message
from radixserve.server.tokenizer_utils import special_token_ids
from radixserve.server.tool_parsers.streaming import ToolCallStream

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
MARKERS = {"mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}
# what the model writes (ending in its EOS, <|im_end|> for SmolLM2), with another special
# token inside the content that must not show
OUTPUTS = {
    "mistral": ('Sure<file_sep>, checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": '
                '{"city": "Oslo", "unit": "c"}}]<|im_end|>'),
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
              '<|im_end|>',
}
CONTENT = {"mistral": "Sure, checking.", "llama3": None}
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def marker_tokenizer() -> Any:
    """SmolLM2's tokenizer with both markers added as special tokens (its own copy: the
    session's tokenizer fixture stays as it is)."""
    from radixserve.loader.tokenizer import get_tokenizer

    tokenizer = get_tokenizer("SmolLM2-135M-Instruct")
    tokenizer.add_tokens(list(MARKERS.values()), special_tokens=True)
    return tokenizer


def _context(tokenizer: Any, parser: str) -> OpenAIContext:
    manager = SimpleNamespace(tokenizer=tokenizer, limits=SimpleNamespace(context_len=8192),
                              generation_defaults={},
                              make_request=lambda **kw: SimpleNamespace(**kw))
    return OpenAIContext(manager, "m", frozenset(), tool_call_parser=parser)  # type: ignore


def _chat_params(tokenizer: Any, parser: str, **fields: Any) -> tuple[SamplingParams, ToolPlan]:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 64,
         **fields})
    reqs, plan, _ = build_requests(_context(tokenizer, parser), body)
    return reqs[0].sampling_params, plan


def _run(tokenizer: Any, params: SamplingParams, text: str, chunk: int) -> list[str]:
    """The text deltas of a request whose model writes `text`: token by token through
    Req.check_finished, sent every `chunk` tokens (and on finishing) through the scheduler's
    output and the DetokenizerManager."""
    params.normalize()
    req = Req("r", [1, 2, 3], params, stream=True)
    detokenizer = DetokenizerManager(tokenizer)
    deltas = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        req.output_ids.append(token)
        req.check_finished({EOS}, 8192, tokenizer)
        if req.finished or len(req.output_ids) - req.sent_output_len >= chunk:
            deltas += detokenizer.convert(build_token_output([req])).text_deltas
        if req.finished:
            break
    assert req.finished_reason is not None and detokenizer.states == {}
    return deltas


def test_markers_are_special_tokens_of_the_test_tokenizer(marker_tokenizer: Any) -> None:
    specials = special_token_ids(marker_tokenizer)
    for marker in MARKERS.values():
        ids = marker_tokenizer.encode(marker, add_special_tokens=False)
        assert len(ids) == 1 and specials[marker] == ids[0]
        # what goes wrong without keeping: skip_special_tokens drops the marker
        assert marker_tokenizer.decode(ids, skip_special_tokens=True) == ""


@pytest.mark.parametrize("parser", sorted(MARKERS))
@pytest.mark.parametrize("tool_choice", [None, "auto", "required"])
def test_tool_requests_keep_the_marker_only(marker_tokenizer: Any, parser: str,
                                            tool_choice: Any) -> None:
    params, _ = _chat_params(marker_tokenizer, parser, tools=[WEATHER], tool_choice=tool_choice)
    assert params.keep_special_tokens == (MARKERS[parser],)
    assert params.skip_special_tokens  # the request's own setting is unchanged


@pytest.mark.parametrize("fields", [{}, {"tools": [WEATHER], "tool_choice": "none"}],
                         ids=["no-tools", "tool-choice-none"])
def test_requests_without_tool_parsing_keep_nothing(marker_tokenizer: Any,
                                                    fields: dict[str, Any]) -> None:
    params, _ = _chat_params(marker_tokenizer, "mistral", **fields)
    assert params.keep_special_tokens == ()


def test_a_marker_that_is_plain_text_is_not_kept(marker_tokenizer: Any,
                                                 smollm_tokenizer: Any) -> None:
    # hermes' <tool_call> is not a special token of SmolLM2 (nor of Qwen's vocabularies)
    assert _chat_params(marker_tokenizer, "hermes", tools=[WEATHER])[0].keep_special_tokens == ()
    # the bundled tokenizer has no [TOOL_CALLS] token: nothing to keep
    assert _chat_params(smollm_tokenizer, "mistral",
                        tools=[WEATHER])[0].keep_special_tokens == ()


@pytest.mark.parametrize("parser", sorted(MARKERS))
@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_detokenized_tool_call_parses(marker_tokenizer: Any, parser: str, chunk: int) -> None:
    """Through the detokenizer the text keeps the marker and loses <|im_end|> and
    <file_sep>; finished and streamed, the call parses and the content is clean."""
    params, plan = _chat_params(marker_tokenizer, parser, tools=[WEATHER])
    deltas = _run(marker_tokenizer, params, OUTPUTS[parser], chunk)
    text = "".join(deltas)
    assert MARKERS[parser] in text and "<|im_end|>" not in text and "<file_sep>" not in text
    message, called = tool_message(plan, text)
    assert called and message["content"] == CONTENT[parser]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Oslo", "unit": "c"})]
    # streamed: the deltas as the chat handler sees them (cumulative text)
    stream, content, arguments, names = ToolCallStream(plan.parser), "", "", []
    so_far = ""
    for i, delta in enumerate(deltas):
        so_far += delta
        new_content, tool_deltas = stream.update(so_far, final=i == len(deltas) - 1)
        content += new_content
        for d in tool_deltas:
            names += [d["function"]["name"]] if "name" in d["function"] else []
            arguments += d["function"]["arguments"]
    assert content.strip() == (CONTENT[parser] or "")
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Oslo", "unit": "c"}


@pytest.mark.parametrize("parser", sorted(MARKERS))
def test_without_keeping_the_marker_the_call_is_lost(marker_tokenizer: Any,
                                                     parser: str) -> None:
    """The bug kept markers fix: plain skip_special_tokens decoding drops the marker, and
    mistral's call with it (llama3's bare JSON still parses, its content rule says so)."""
    params, plan = _chat_params(marker_tokenizer, parser, tools=[WEATHER])
    params.keep_special_tokens = ()
    text = "".join(_run(marker_tokenizer, params, OUTPUTS[parser], 3))
    assert MARKERS[parser] not in text
    if parser == "mistral":
        assert not tool_message(plan, text)[1]


def test_user_skip_special_tokens_false_keeps_everything(marker_tokenizer: Any) -> None:
    """Every special token's text, but the EOS that ended the request (left out as vLLM leaves
    it out, unless include_stop_str_in_output)."""
    params, _ = _chat_params(marker_tokenizer, "mistral", tools=[WEATHER],
                             skip_special_tokens=False)
    text = "".join(_run(marker_tokenizer, params, OUTPUTS["mistral"], 4))
    assert OUTPUTS["mistral"].endswith("<|im_end|>")
    assert text == OUTPUTS["mistral"].removesuffix("<|im_end|>")
    params.include_stop_str_in_output = True
    text = "".join(_run(marker_tokenizer, params, OUTPUTS["mistral"], 4))
    assert text == OUTPUTS["mistral"]


def test_incremental_detokenizer_keeps_only_the_listed_special_tokens(
        marker_tokenizer: Any) -> None:
    ids = marker_tokenizer.encode(OUTPUTS["mistral"], add_special_tokens=False)
    detok = IncrementalDetokenizer(marker_tokenizer, keep_special_tokens=("[TOOL_CALLS]",))
    text = "".join(detok.append([t]) for t in ids[:-1]) + detok.finish(ids[-1:])
    specials = set(special_token_ids(marker_tokenizer).values()) - {
        special_token_ids(marker_tokenizer)["[TOOL_CALLS]"]}
    expected = marker_tokenizer.decode([t for t in ids if t not in specials],
                                       skip_special_tokens=False)
    assert text == expected == OUTPUTS["mistral"].replace("<file_sep>", "").replace(
        "<|im_end|>", "")


def test_keep_special_tokens_is_not_a_request_field() -> None:
    with pytest.raises(InvalidRequestError, match="keep_special_tokens"):
        SamplingParams.from_dict({"keep_special_tokens": ["<|im_end|>"]})
