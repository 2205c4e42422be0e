"""DeepSeek-V3 / R1 and V3.1 tool calls (tool_parsers/deepseek.py) beyond the shared cases of
test_tool_parsers.py (parse and streamed deltas of both formats, the forced grammar through
the generic tests): the flag names and template detection, output cut mid-call, content held
back while it may become the section's marker, the forced grammar over a vocabulary where the
markers are single tokens, the five markers kept through the detokenizer, and tool turns
through DeepSeek-like templates (which concatenate the arguments as text) and through one that
knows no tool calls."""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest

from radixserve.core.server_flags import FLAGS
from radixserve.server.openai_chat import render_prompt
from radixserve.server.openai_common import OpenAIContext
from radixserve.server.openai_tools import plan_tools, render_conversation, tool_message
from radixserve.server.tool_parsers.base import ToolCall
from radixserve.server.tool_parsers.deepseek import (CALL_BEGIN, CALL_END, CALLS_BEGIN,
                                                     CALLS_END, MARKERS, SEP,
                                                     DeepSeekV3Parser, DeepSeekV31Parser)
from radixserve.server.tool_parsers.grammar import forced_call_ebnf
from radixserve.server.tool_parsers.registry import (PARSERS, detect_parser_name,
                                                     get_parser)
from radixserve.server.tool_parsers.streaming import ToolCallStream
from tests.server.test_tool_parsers import (ONE_CALL, TIME, TWO_CALLS, WEATHER, _accepts, _chat,
                                            stream_text)
from tests.server.conftest import tokenizer_with_special_tokens
from tests.server.test_tool_special_tokens import _chat_params, _run

FORMATS = ["deepseek_v3", "deepseek_v31"]


def test_flag_names_are_vllm_and_sglang_spellings() -> None:
    assert set(FLAGS["tool_call_parser"][2]) == set(PARSERS)  # --tool-call-parser's choices
    for name in ("deepseek_v3", "deepseekv3"):
        assert type(get_parser(name)) is DeepSeekV3Parser
    for name in ("deepseek_v31", "deepseekv31"):
        assert type(get_parser(name)) is DeepSeekV31Parser


# the tool-call lines of DeepSeek's templates (V3-0324 / R1-0528 and V3.1 as published, V3.1
# as SGLang's example template rewrites it) and of one that writes the format in prose
V3_TEMPLATE = ("{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
               "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
               "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}")
V3_PROSE = "answer with <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME"
V31_TEMPLATE = ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + "
                "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}")
V31_TOJSON = V31_TEMPLATE.replace("['arguments'] +", "['arguments']|tojson +")
V31_PROSE = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>"
             "tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>")


@pytest.mark.parametrize("template,name", [
    (V3_TEMPLATE, "deepseek_v3"), (V3_PROSE, "deepseek_v3"),
    (V3_TEMPLATE.replace("tool['type']", "tool.type"), "deepseek_v3"),
    (V31_TEMPLATE, "deepseek_v31"), (V31_TOJSON, "deepseek_v31"), (V31_PROSE, "deepseek_v31"),
    # a DeepSeek marker and the fence, nothing else recognisable: V3's fence decides
    ("<｜tool▁calls▁begin｜> ```json", "deepseek_v3"),
])
def test_detect_deepseek_from_template(template: str, name: str) -> None:
    assert detect_parser_name(template) == name


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_output_cut_mid_arguments(name: str, chunk: int) -> None:
    """max_tokens cut the second call inside a string: the finished parse keeps it only with
    keep_unfinished, as far as the stream sent it; a lone cut call does not finish the answer
    as tool_calls."""
    parser = get_parser(name)
    full = parser.format_calls([ToolCall("get_time", '{"zone": "UTC"}'),
                                ToolCall("get_weather", '{"city": "Pa}ris", "unit": "c"}')])
    text = full[:full.index("Pa}") + 3]
    content, calls = parser.parse(text, keep_unfinished=True)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Pa}')]
    assert [c.name for c in parser.parse(text)[1]] == ["get_time"]
    assert stream_text(name, text, chunk) == ("", [(c.name, c.arguments) for c in calls], True)
    # the only call cut: no call completes, the finish stays "length"
    alone = parser.format_calls(ONE_CALL)
    alone = alone[:alone.index("Paris")]
    assert parser.parse(alone) == ("", [])  # begun, so not content (a stream sent its name)
    assert stream_text(name, alone, chunk)[2] is False


@pytest.mark.parametrize("name", FORMATS)
def test_unfinished_markers_and_headers(name: str) -> None:
    parser = get_parser(name)
    # content that may still become the section's marker is held back, until it cannot
    assert parser.scan("Sure <｜tool▁cal").content_end == len("Sure ")
    assert parser.scan("Sure <｜tool▁cal", final=True).content_end == len("Sure <｜tool▁cal")
    assert parser.scan("Sure <｜tool▁cax").content_end == len("Sure <｜tool▁cax")
    text = parser.format_calls(ONE_CALL)
    # every prefix: the name appears only whole, the arguments only grow, as prefixes of the
    # finished call's (markers and the fence never leak into them)
    seen = ""
    for end in range(len(text) + 1):
        calls = parser.scan(text[:end]).calls
        if calls and calls[0].name is not None:
            assert calls[0].name == "get_weather"
            assert calls[0].arguments.startswith(seen)
            seen = calls[0].arguments
    assert seen == ONE_CALL[0].arguments
    # a complete call whose closing marker is cut or missing still counts (as hermes')
    assert parser.parse(text[:text.index(CALL_END) + 3])[1] == ONE_CALL


def test_malformed_arguments_do_not_stream_the_markers() -> None:
    parser = get_parser("deepseek_v3")
    text = (f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n{{\"zone\": oops}}\n```"
            f"{CALL_END}{CALLS_END}")
    assert parser.parse(text) == ("", [])  # a call begun: not content, as streamed
    assert parser.scan(text).calls[0].arguments == '{"zone": oops}'


@pytest.mark.parametrize("name,text", [
    # V3.1's parser over arguments that are not an object (a probe forced "[1, 2]")
    ("deepseek_v31", f"Hi{CALLS_BEGIN}{CALL_BEGIN}get_time{SEP}[1, 2]{CALL_END}{CALLS_END}"),
    # V3's format read by V3.1's parser: "function" would be the name, "get_time..." the
    # arguments
    ("deepseek_v31", f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n"
                     f'{{"zone": "UTC"}}\n```{CALL_END}{CALLS_END}'),
    ("deepseek_v3", f"Hi{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n\"UTC\""
                    f"\n```{CALL_END}{CALLS_END}")])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_a_section_without_object_arguments_is_content_streamed_or_not(
        name: str, text: str, chunk: int) -> None:
    """No call is streamed before its arguments open with "{": the stream joined equals the
    finished parse, which reads the whole text as content (a call's name once sent cannot be
    taken back)."""
    assert get_parser(name).parse(text) == (text, [])
    assert stream_text(name, text, chunk) == (text, [], False)


def _vocabulary_matcher(ebnf: str) -> tuple[Any, dict[str, int]]:
    """A matcher over a vocabulary of printable ASCII, the newline and the five markers as
    single tokens (as in DeepSeek's vocabulary), and the markers' token ids."""
    import xgrammar

    vocabulary = [chr(c) for c in range(32, 127)] + ["\n", *MARKERS]
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(vocabulary)).compile_grammar(
        xgrammar.Grammar.from_ebnf(ebnf))
    return xgrammar.GrammarMatcher(compiled), {m: vocabulary.index(m) for m in MARKERS}


def _accepts_tokens(ebnf: str, text: str) -> bool:
    """Whether the grammar takes `text` written with the markers as their single tokens."""
    matcher, ids = _vocabulary_matcher(ebnf)
    pos = 0
    while pos < len(text):
        marker = next((m for m in MARKERS if text.startswith(m, pos)), None)
        ok = matcher.accept_token(ids[marker]) if marker else matcher.accept_string(text[pos])
        if not ok:
            return False
        pos += len(marker) if marker else 1
    return matcher.is_completed()


@pytest.mark.parametrize("name", FORMATS)
def test_forced_grammar_over_marker_tokens(name: str) -> None:
    parser = get_parser(name)
    required = forced_call_ebnf(parser, [WEATHER, TIME], parallel=True)
    assert _accepts_tokens(required, parser.format_calls(ONE_CALL))
    assert _accepts_tokens(required, parser.format_calls(TWO_CALLS))
    assert not _accepts_tokens(forced_call_ebnf(parser, [WEATHER, TIME]),
                               parser.format_calls(TWO_CALLS))
    # a name that is not a tool's, and a named call's other tool, are refused
    wrong = parser.format_calls([ToolCall("get_wether", ONE_CALL[0].arguments)])
    assert not _accepts(required, wrong) and not _accepts_tokens(required, wrong)
    named = forced_call_ebnf(parser, [TIME])
    assert not _accepts_tokens(named, parser.format_calls(ONE_CALL))
    assert _accepts_tokens(named, parser.format_calls([ToolCall("get_time", '{"zone": "Z"}')]))
    # the answer opens with the section's marker: content first is refused
    matcher, ids = _vocabulary_matcher(required)
    assert not matcher.accept_string("I") and matcher.accept_token(ids[CALLS_BEGIN])


@pytest.fixture(scope="module")
def deepseek_tokenizer() -> Any:
    """SmolLM2's tokenizer with DeepSeek's five tool markers added as special tokens."""
    return tokenizer_with_special_tokens(MARKERS)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("tool_choice", [None, "required"])
def test_tool_requests_keep_all_five_markers(deepseek_tokenizer: Any, name: str,
                                             tool_choice: Any) -> None:
    params, _ = _chat_params(deepseek_tokenizer, name, tools=[WEATHER], tool_choice=tool_choice)
    assert params.keep_special_tokens == MARKERS
    assert _chat_params(deepseek_tokenizer, name)[0].keep_special_tokens == ()


def test_markers_of_plain_text_are_not_kept(smollm_tokenizer: Any) -> None:
    assert _chat_params(smollm_tokenizer, "deepseek_v3",
                        tools=[WEATHER])[0].keep_special_tokens == ()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_detokenized_calls_parse(deepseek_tokenizer: Any, name: str, chunk: int) -> None:
    """Through the detokenizer the text keeps the five markers and loses <|im_end|> and
    <file_sep>; finished and streamed, both calls parse and the content is clean."""
    params, plan = _chat_params(deepseek_tokenizer, name, tools=[WEATHER, TIME])
    output = "Sure<file_sep>, checking." + plan.parser.format_calls(TWO_CALLS) + "<|im_end|>"
    deltas = _run(deepseek_tokenizer, params, output, chunk)
    text = "".join(deltas)
    assert all(m in text for m in MARKERS) and "<|im_end|>" not in text
    assert "<file_sep>" not in text
    message, called = tool_message(plan, text)
    assert called and message["content"] == "Sure, checking."
    expected = [(c.name, json.loads(c.arguments)) for c in TWO_CALLS]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == expected
    stream, content, so_far = ToolCallStream(plan.parser), "", ""
    arguments: dict[int, str] = {}
    for i, delta in enumerate(deltas):
        so_far += delta
        new_content, tool_deltas = stream.update(so_far, final=i == len(deltas) - 1)
        content += new_content
        for d in tool_deltas:
            arguments[d["index"]] = arguments.get(d["index"], "") + d["function"]["arguments"]
    assert content == "Sure, checking."
    assert [json.loads(arguments[i]) for i in sorted(arguments)] == [e[1] for e in expected]


# DeepSeek-like templates: a system turn, user turns, assistant tool calls written with `+`
# around the arguments (their JSON text) as DeepSeek's own templates write them, tool turns
_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined -%}"
    "{{ '<｜Assistant｜><｜tool▁calls▁begin｜>' }}"
    "{%- for tool in message['tool_calls'] -%}CALL{%- endfor -%}"
    "{{ '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{%- endif -%}{%- endfor -%}{{ '<｜Assistant｜>' }}")
TEMPLATES = {
    "deepseek_v3": _TEMPLATE.replace("CALL", (
        "{%- if not loop.first %}{{ '\\n' }}{% endif -%}"
        "{{ '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name']"
        " + '\\n```json\\n' + tool['function']['arguments'] + '\\n```<｜tool▁call▁end｜>' }}")),
    "deepseek_v31": _TEMPLATE.replace("CALL", (
        "{{ '<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + "
        "tool['function']['arguments'] + '<｜tool▁call▁end｜>' }}")),
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris, time in UTC?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in enumerate(TWO_CALLS)]},
    {"role": "tool", "tool_call_id": "call_0", "content": "21 degrees"},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]


@pytest.mark.parametrize("name", FORMATS)
def test_history_through_deepseek_like_templates(smollm_tokenizer: Any, name: str) -> None:
    """The template's parser is detected; the calls reach it with their arguments as JSON
    text (a dict would fail its `+`), render as the format the parser reads, and the tools
    (the template does not render them) come in a system prompt in that format."""
    tokenizer = copy.copy(smollm_tokenizer)
    tokenizer.chat_template = TEMPLATES[name]
    ctx = OpenAIContext(tokenizer_manager=SimpleNamespace(tokenizer=tokenizer),  # type: ignore
                        model_name="m", model_aliases=frozenset({"m"}))
    prompt, _, plan = render_prompt(ctx, _chat(messages=HISTORY, tools=[WEATHER, TIME]))
    assert plan.parser.name == name
    example = {"deepseek_v3": f"{SEP}<function-name>\n```json\n{{",
               "deepseek_v31": f"<function-name>{SEP}{{"}[name]
    assert prompt.startswith("You may call functions") and example in prompt
    section = prompt[prompt.index("<｜Assistant｜>" + CALLS_BEGIN) + len("<｜Assistant｜>"):]
    section = section[:section.index(CALLS_END) + len(CALLS_END)]
    assert section == plan.parser.format_calls(TWO_CALLS)
    assert plan.parser.parse(section) == ("", TWO_CALLS)
    assert prompt.endswith("<｜tool▁output▁begin｜>12:00<｜tool▁output▁end｜><｜Assistant｜>")


def test_templates_with_tojson_get_arguments_as_objects() -> None:
    template = TEMPLATES["deepseek_v31"].replace("['arguments'] +", "['arguments']|tojson +")
    body = _chat(messages=HISTORY, tools=[WEATHER, TIME])
    for chat_template, kind in [(template, dict), (TEMPLATES["deepseek_v31"], str)]:
        plan = plan_tools(body, None, chat_template)
        calls = next(m["tool_calls"] for m in render_conversation(body, plan, chat_template)
                     if "tool_calls" in m)
        assert isinstance(calls[0]["function"]["arguments"], kind)


@pytest.mark.parametrize("name", FORMATS)
def test_history_through_a_template_without_tool_calls(smollm_tokenizer: Any,
                                                       name: str) -> None:
    body = _chat(messages=HISTORY[:3], tools=[WEATHER])
    template = smollm_tokenizer.chat_template
    plan = plan_tools(body, name, template)
    prompt = smollm_tokenizer.apply_chat_template(render_conversation(body, plan, template),
                                                  tokenize=False, add_generation_prompt=True)
    calls = get_parser(name).format_calls(TWO_CALLS)
    assert f"<|im_start|>assistant\n{calls}<|im_end|>" in prompt
    assert calls.startswith(CALLS_BEGIN + CALL_BEGIN) and calls.endswith(CALL_END + CALLS_END)
