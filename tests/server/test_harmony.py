"""gpt-oss's Harmony output (server/harmony.py, tool_parsers/harmony.py): the split into
reasoning, answer and calls, finished and streamed in chunks of every size (the deltas add up
to the finished split); calls in both header orders, preambles, built-in recipients left
out; the server's default format and parser from a Harmony template; the forced-call grammar
accepting the model's own header; the seven tags kept through the detokenizer and the calls
read from its output."""
from __future__ import annotations

import json
from typing import Any

import pytest

from radixserve.server.harmony import MARKERS, split_harmony
from radixserve.server.openai_chat import choice_of
from radixserve.server.openai_tools import tool_message
from radixserve.server.reasoning import (ReasoningSplit, ReasoningStream, get_format,
                                         reasoning_format)
from radixserve.server.tool_parsers.base import ToolCall
from radixserve.server.tool_parsers.grammar import forced_call_ebnf
from radixserve.server.tool_parsers.harmony import HarmonyToolParser
from radixserve.server.tool_parsers.registry import detect_parser_name, get_parser
from radixserve.server.tool_parsers.streaming import ToolCallStream
from tests.server.conftest import tokenizer_with_special_tokens
from tests.server.test_tool_parsers import TIME, WEATHER, _accepts, _chat
from tests.server.test_tool_special_tokens import _chat_params, _run

ANALYSIS = "<|channel|>analysis<|message|>User asks the weather. Call the tool.<|end|>"
# (output, reasoning, content, calls)
CASES = [
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.",
     "User asks the weather. Call the tool.", "It is sunny in Paris.", []),
    # a call after the reasoning, the recipient in the channel's header (<|call|>, the EOS,
    # put back at the end by the chat route: harmony.with_call_end)
    (ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>'
     'json<|message|>{"city": "Paris", "unit": "c"}<|call|>',
     "User asks the weather. Call the tool.", "",
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    # the recipient after the role, a preamble before the call, the call's end tag written
    ('<|channel|>commentary<|message|>Checking the time.<|end|><|start|>assistant '
     'to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>',
     None, "Checking the time.", [("get_time", {"zone": "UTC"})]),
    # a built-in tool's message is left out; no reasoning
    ('<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|end|><|start|>assistant'
     '<|channel|>final<|message|>Done.', None, "Done.", []),
    # no tags at all: all of it is the answer
    ("Plain text, no channels.", None, "Plain text, no channels.", []),
]


@pytest.mark.parametrize("output,reasoning,content,calls", CASES)
def test_split_and_calls_of_finished_outputs(output: str, reasoning: str | None, content: str,
                                             calls: list) -> None:
    thought, answer = split_harmony(output)
    assert thought == reasoning
    got_content, got_calls = get_parser("openai", None, [WEATHER, TIME]).parse(answer)
    assert (got_content if calls else answer) == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize("output,reasoning,content,calls", CASES)
@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_streamed_deltas_add_up(output: str, reasoning: str | None, content: str,
                                calls: list, chunk: int) -> None:
    """Through the reasoning stream then the tool-call stream, as the chat route streams."""
    fmt = get_format("gpt-oss")
    thoughts, tools = ReasoningStream(ReasoningSplit(fmt)), ToolCallStream(HarmonyToolParser())
    sent_thought, sent_content, arguments, names = "", "", {}, {}
    ends = list(range(chunk, len(output), chunk)) + [len(output)]
    for end in ends:
        final = end == len(output)
        delta, answer = thoughts.update(output[:end], final)
        sent_thought += delta
        text, deltas = tools.update(answer, final)
        sent_content += text
        for d in deltas:
            if "id" in d:
                names[d["index"]] = d["function"]["name"]
            arguments[d["index"]] = arguments.get(d["index"], "") + d["function"]["arguments"]
    assert sent_thought == (reasoning or "")
    assert sent_content == content
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == calls
    assert tools.has_calls == bool(calls)


def test_messages_join_and_calls_only_where_parsed() -> None:
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
    final = "<|channel|>final<|message|>Done."
    assert split_harmony(preamble + final) == (None, "Checking.\nDone.")
    call = CASES[1][0]  # analysis, then a call
    assert split_harmony(call, keep_calls=False) == (CASES[1][1], "")
    assert "<|" in split_harmony(call)[1]  # the canonical call, for the tool parser


def test_response_format_answers_in_the_final_channel(harmony_tokenizer: Any) -> None:
    """A constrained answer skips the analysis: the prompt ends with the final message's
    header, so the grammar applies from the answer's first token; a forced call does not (its
    grammar writes the call's header)."""
    from types import SimpleNamespace

    from radixserve.server.openai_chat import build_requests
    from radixserve.server.openai_common import OpenAIContext
    from radixserve.server.openai_protocol import ChatCompletionRequest
    manager = SimpleNamespace(tokenizer=harmony_tokenizer, generation_defaults={},
                              limits=SimpleNamespace(context_len=8192,
                                                     max_sequence_tokens=8192),
                              make_request=lambda **kw: SimpleNamespace(**kw))
    ctx = OpenAIContext(manager, "m", frozenset(),  # type: ignore[arg-type]
                        reasoning=get_format("gpt-oss"))

    def prompt_of(**fields: Any) -> tuple[str, Any]:
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **fields})
        reqs, _, split = build_requests(ctx, body)
        return reqs[0].text, split

    plain, split = prompt_of()
    assert plain.endswith("<|start|>assistant") and split.keep_calls is False
    constrained, split = prompt_of(response_format={"type": "json_object"})
    assert constrained == plain + "<|channel|>final<|message|>" and split is not None
    forced, split = prompt_of(tools=[WEATHER], tool_choice="required")
    assert forced.endswith("<|start|>assistant") and split.keep_calls


def test_only_call_end_completes_a_call() -> None:
    """A call cut by a stop string (or <|return|>) is unfinished: no call, no tags in the
    content; max_tokens keeps it partial (parse's keep_unfinished); the EOS <|call|> is put
    back by with_call_end from the finish reason; an output cut inside its first header has
    no answer."""
    from radixserve.server.harmony import with_call_end
    parser = get_parser("openai", None, [WEATHER])
    cut = CASES[1][0][:-len('"c"}<|call|>')]
    _, answer = split_harmony(cut)
    assert parser.parse(answer) == ("", [])
    assert parser.parse(answer, keep_unfinished=True)[1][0].name == "get_weather"
    whole = CASES[1][0][:-len("<|call|>")]
    assert with_call_end(whole, {"type": "stop", "matched": 7}, 7) == CASES[1][0]
    assert with_call_end(whole, {"type": "stop", "matched": 8}, 7) == whole
    assert with_call_end(whole, {"type": "length", "length": 9}, 7) == whole
    # a forced call: its grammar was complete before any EOS could end it
    assert with_call_end(whole, {"type": "stop", "matched": 8}, 7, True) == CASES[1][0]
    assert with_call_end(whole, {"type": "stop", "matched": "}"}, 7, True) == whole
    assert split_harmony("<|channel|>commentary to=functions.get_weather <|constrain|>json") \
        == (None, "")
    # a final message after a call (a malformed output) is left out, streamed or not
    after = CASES[1][0] + "<|start|>assistant<|channel|>final<|message|>Sunny."
    assert parser.parse(split_harmony(after)[1])[0] == ""


def test_partial_tags_are_held_back() -> None:
    assert split_harmony("<|chan", final=False) == (None, "")
    assert split_harmony("<|channel|>final<|message|>Hi <|e", final=False) == (None, "Hi ")
    assert split_harmony("<|channel|>analysis<|message|>hmm", final=False) == ("hmm", "")


def test_server_defaults_from_a_harmony_template(smollm_tokenizer: Any) -> None:
    class Tokenizer:
        chat_template = "{{ '<|start|>assistant<|channel|>final<|message|>' }}"
    assert reasoning_format(None, Tokenizer()) is get_format("openai_gptoss")
    assert reasoning_format(None, smollm_tokenizer) is None
    assert reasoning_format("qwen3", Tokenizer()).name == "qwen3"
    assert detect_parser_name(Tokenizer.chat_template) == "openai"
    assert type(get_parser("harmony")) is HarmonyToolParser


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_grammar_is_the_models_own_header(parallel: bool) -> None:
    parser = get_parser("openai")
    ebnf = forced_call_ebnf(parser, [WEATHER, TIME], parallel)
    raw = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
           '{"city": "Paris", "unit": "c"}')
    assert _accepts(ebnf, raw)
    assert not _accepts(ebnf, raw.replace('"c"', '"k"'))
    assert not _accepts(ebnf, raw + raw)  # one call per turn: <|call|> ends the output
    # what the split makes of it, with the EOS that ended it put back, is the call
    ended = raw + "<|call|>"
    _, answer = split_harmony(ended)
    assert parser.parse(answer)[1] == [ToolCall("get_weather", '{"city": "Paris", "unit": "c"}')]
    assert parser.parse(ended)[1][0].name == "get_weather"  # read without the split too


@pytest.fixture(scope="module")
def harmony_tokenizer() -> Any:
    tokenizer = tokenizer_with_special_tokens(MARKERS)
    tokenizer.chat_template = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>"
                               "{{ m.content }}<|end|>{% endfor %}<|start|>assistant")
    return tokenizer


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_through_the_detokenizer(harmony_tokenizer: Any, chunk: int) -> None:
    """The tags survive detokenisation (kept for the split); the finished choice has the
    reasoning, the call and finish_reason tool_calls."""
    params, plan = _chat_params(harmony_tokenizer, "openai", tools=[WEATHER, TIME])
    fmt = get_format("gpt-oss")
    params.keep_special_tokens += tuple(m for m in fmt.tags
                                        if m not in params.keep_special_tokens)
    output = CASES[1][0].replace("<|call|>", "<|im_end|>")  # the test's EOS ends it
    text = "".join(_run(harmony_tokenizer, params, output, chunk))
    assert text == CASES[1][0][:-len("<|call|>")]
    text += "<|call|>"  # as with_call_end puts it back where <|call|> ended the output
    thought, answer = split_harmony(text)
    message, called = tool_message(plan, answer)
    assert called and thought == CASES[1][1]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == CASES[1][3][0][1]


def test_choice_of_a_harmony_answer() -> None:
    from types import SimpleNamespace
    body = _chat(tools=[WEATHER])
    plan = SimpleNamespace(parse_output=True, parser=get_parser("openai", None, [WEATHER]),
                           max_calls=None)
    out = SimpleNamespace(text=CASES[0][0], finished=True,
                          meta_info={"finish_reason": {"type": "stop"}})
    choice = choice_of(body, plan, 0, out, None, ReasoningSplit(get_format("gpt-oss")), True)
    assert choice["message"]["reasoning_content"] == CASES[0][1]
    assert choice["message"]["content"] == CASES[0][2]
    assert choice["finish_reason"] == "stop"
