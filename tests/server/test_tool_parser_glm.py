"""GLM-4.5 / 4.6 / 4.7 tool calls (tool_parsers/glm.py) beyond the shared cases of
test_tool_parsers.py: the flag names and template detection (before hermes, whose tag GLM's
templates also write), values read by the request's tools' schemas, an output cut mid-call,
the forced grammar's pairs (required, optional, typed, text values), the six tags kept
through the detokenizer where they are special tokens, and tool turns through a GLM-like
template (which iterates the arguments as a mapping)."""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from radixserve.server.openai_chat import render_prompt
from radixserve.server.openai_common import OpenAIContext
from radixserve.server.openai_tools import plan_tools, tool_message
from radixserve.server.reasoning import get_format
from radixserve.server.tool_parsers.base import ToolCall
from radixserve.server.tool_parsers.glm import MARKERS, Glm45Parser, Glm47Parser
from radixserve.server.tool_parsers.grammar import forced_call_ebnf
from radixserve.server.tool_parsers.registry import detect_parser_name, get_parser
from tests.server.test_tool_parsers import (TIME, TWO_CALLS, WEATHER, _accepts, _chat, _matcher,
                                           stream_text)
from tests.server.conftest import tokenizer_with_special_tokens
from tests.server.test_tool_special_tokens import _chat_params, _run

FORMATS = ["glm45", "glm47"]
# typed parameters: a string that looks like a number, an integer, a boolean, an object
BOOKING = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {
        "code": {"type": "string"}, "nights": {"type": "integer"},
        "late": {"type": "boolean"}, "guest": {"type": "object", "properties": {
            "name": {"type": "string"}}, "required": ["name"]}},
    "required": ["code", "nights"]}}}

# the tool parts of GLM's chat templates (4.5 / 4.6: a newline after the name and each tag;
# 4.7: none), the arguments iterated as a mapping, strings written as they are
_CALL = {
    "glm45": ("{{ '\\n<tool_call>' + tc.name }}{% for k, v in tc.arguments.items() %}"
              "{{ '\\n<arg_key>' + k + '</arg_key>\\n<arg_value>' }}"
              "{{ v if v is string else v | tojson }}{{ '</arg_value>' }}{% endfor %}"
              "{{ '\\n</tool_call>' }}"),
    "glm47": ("{{ '<tool_call>' + tc.name }}{% for k, v in tc.arguments.items() %}"
              "{{ '<arg_key>' + k + '</arg_key><arg_value>' }}"
              "{{ v if v is string else v | tojson }}{{ '</arg_value>' }}{% endfor %}"
              "{{ '</tool_call>' }}"),
}
TEMPLATES = {name: (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{ '<|user|>\\n' + m.content }}"
    "{%- elif m.role == 'assistant' -%}{{ '<|assistant|>' }}"
    "{%- if m.content %}{{ m.content }}{% endif -%}"
    "{%- for tc in m.tool_calls or [] -%}{%- set tc = tc.function -%}" + call + "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}{{ '<|observation|>\\n<tool_response>' + m.content + "
    "'</tool_response>' }}{%- endif -%}{%- endfor -%}<|assistant|>")
    for name, call in _CALL.items()}


def test_flag_names_and_template_detection() -> None:
    assert type(get_parser("glm45")) is Glm45Parser and type(get_parser("glm47")) is Glm47Parser
    for name, template in TEMPLATES.items():
        assert detect_parser_name(template) == name  # not hermes, despite <tool_call>
    assert get_format("glm45").name == "qwen3"  # --reasoning-parser glm45


def assert_values_read_by_the_tools_schemas(parser: str, text: str) -> None:
    """`text`: one call of `book` with code "007", nights 3, late true, guest {"name": "Ann"}
    and a note "not JSON", in `parser`'s format."""
    _, calls = get_parser(parser, None, [BOOKING]).parse(text)
    assert json.loads(calls[0].arguments) == {"code": "007", "nights": 3, "late": True,
                                              "guest": {"name": "Ann"}, "note": "not JSON"}
    # without the tools, a value is JSON where it parses: the string parameter's "007" is not
    assert json.loads(get_parser(parser).parse(text)[1][0].arguments)["code"] == "007"
    text = text.replace("007", "12")
    assert json.loads(get_parser(parser).parse(text)[1][0].arguments)["code"] == 12
    assert json.loads(get_parser(parser, None, [BOOKING]).parse(text)[1][0].arguments)[
        "code"] == "12"


def test_values_read_by_the_tools_schemas() -> None:
    assert_values_read_by_the_tools_schemas("glm45", (
        "<tool_call>book\n<arg_key>code</arg_key>\n<arg_value>007</arg_value>\n"
        "<arg_key>nights</arg_key>\n<arg_value>3</arg_value>\n<arg_key>late</arg_key>\n"
        "<arg_value>true</arg_value>\n<arg_key>guest</arg_key>\n<arg_value>"
        '{"name": "Ann"}</arg_value>\n<arg_key>note</arg_key>\n<arg_value>not JSON'
        "</arg_value>\n</tool_call>"))


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_output_cut_mid_call(chunk: int) -> None:
    """max_tokens cut the second pair: no call parses (the finish stays "length") and the
    call begun is not content; the cut output keeps the partial call, and a stream sent the
    name and the first pair only."""
    text = ("<tool_call>book\n<arg_key>code</arg_key>\n<arg_value>A</arg_value>\n"
            "<arg_key>nights</arg_key>\n<arg_value>3")
    parser = get_parser("glm45", None, [BOOKING])
    assert parser.parse(text) == ("", [])
    assert parser.parse(text, keep_unfinished=True)[1] == [ToolCall("book", '{"code": "A"')]
    assert stream_text("glm45", text, chunk, [BOOKING]) == (
        "", [("book", '{"code": "A"')], False)


@pytest.mark.parametrize("name", FORMATS)
def test_forced_grammar_pairs(name: str) -> None:
    assert_forced_grammar_reads_the_schema(name)


def assert_forced_grammar_reads_the_schema(name: str) -> Callable[[dict[str, Any]], str]:
    """`name`'s forced grammar for `book` takes its calls written by the parser, each
    parameter by its schema and in the schema's order; returns the call writer."""
    parser = get_parser(name)
    ebnf = forced_call_ebnf(parser, [BOOKING], parallel=False)

    def call(arguments: dict[str, Any]) -> str:
        return parser.format_calls([ToolCall("book", json.dumps(arguments))])

    assert _accepts(ebnf, call({"code": "x<y>", "nights": 2}))
    assert _accepts(ebnf, call({"code": "", "nights": 0, "late": False,
                                "guest": {"name": "B"}}))
    assert not _accepts(ebnf, call({"nights": 2}))  # a required parameter missing
    assert not _accepts(ebnf, call({"code": "x", "nights": "two"}))  # not an integer
    assert not _accepts(ebnf, call({"code": "x", "nights": 1, "guest": {}}))  # guest.name
    assert not _accepts(ebnf, call({"nights": 1, "code": "x"}))  # the schema's order
    # a text value may hold "</" (code, markup), only not the value's own end tag
    assert _accepts(ebnf, call({"code": "a</b> </div", "nights": 1}))
    markup = get_parser(name, None, [BOOKING]).parse(call({"code": "a</b> </div", "nights": 1}))
    assert json.loads(markup[1][0].arguments) == {"code": "a</b> </div", "nights": 1}
    end_tag = parser.argument_pairs()[2].strip()
    assert not _matcher(ebnf).accept_string(call({"code": f"a{end_tag}b", "nights": 1}))
    return call


def test_forced_grammar_honours_string_constraints() -> None:
    """maxLength / minLength bound a text value, a pattern is its whole match."""
    tool = {"type": "function", "function": {"name": "code", "parameters": {
        "type": "object", "properties": {"short": {"type": "string", "maxLength": 3},
                                         "digits": {"type": "string", "pattern": "^[0-9]{2}$"}},
        "required": ["short", "digits"]}}}
    parser = get_parser("glm45")
    ebnf = forced_call_ebnf(parser, [tool])

    def call(short: str, digits: str) -> str:
        return parser.format_calls([ToolCall("code", json.dumps({"short": short,
                                                                 "digits": digits}))])

    assert _accepts(ebnf, call("abc", "42")) and _accepts(ebnf, call("", "00"))
    assert not _accepts(ebnf, call("abcd", "42"))
    assert not _accepts(ebnf, call("ab", "4x")) and not _accepts(ebnf, call("ab", "421"))


@pytest.fixture(scope="module")
def glm_tokenizer() -> Any:
    """SmolLM2's tokenizer with GLM's six tool tags added as special tokens."""
    return tokenizer_with_special_tokens(MARKERS)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_detokenized_calls_parse(glm_tokenizer: Any, name: str, chunk: int) -> None:
    params, plan = _chat_params(glm_tokenizer, name, tools=[WEATHER, TIME])
    assert params.keep_special_tokens == MARKERS
    output = "Sure, checking." + plan.parser.format_calls(TWO_CALLS) + "<|im_end|>"
    deltas = _run(glm_tokenizer, params, output, chunk)
    text = "".join(deltas)
    assert all(m in text for m in MARKERS) and "<|im_end|>" not in text
    message, called = tool_message(plan, text)
    assert called and message["content"] == "Sure, checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [(c.name, json.loads(c.arguments))
                                                for c in TWO_CALLS]


HISTORY = [
    {"role": "user", "content": "Book it"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {
            "name": "book", "arguments": json.dumps({"code": "12", "nights": 2,
                                                     "guest": {"name": "Ann"}})}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "booked"}]


@pytest.mark.parametrize("name", FORMATS)
def test_history_through_glm_like_templates(smollm_tokenizer: Any, name: str) -> None:
    """The calls reach the template with their arguments as a mapping (it iterates them),
    render as the format the parser reads, and read back with the request's tools."""
    tokenizer = copy.copy(smollm_tokenizer)
    tokenizer.chat_template = TEMPLATES[name]
    ctx = OpenAIContext(tokenizer_manager=SimpleNamespace(tokenizer=tokenizer),  # type: ignore
                        model_name="m", model_aliases=frozenset({"m"}))
    prompt, _, plan = render_prompt(ctx, _chat(messages=HISTORY, tools=[BOOKING]))
    assert plan.parser.name == name and '"name": "book"' in prompt
    call = prompt[prompt.index("<tool_call>"):prompt.index("</tool_call>") + 12]
    assert call == plan.parser.format_calls([ToolCall("book", HISTORY[1]["tool_calls"][0][
        "function"]["arguments"])]).strip()
    assert json.loads(plan.parser.parse(call)[1][0].arguments) == {
        "code": "12", "nights": 2, "guest": {"name": "Ann"}}
    assert prompt.endswith("<tool_response>booked</tool_response><|assistant|>")


def test_required_tool_choice_plan() -> None:
    body = _chat(tools=[BOOKING, TIME], tool_choice="required")
    plan = plan_tools(body, None, TEMPLATES["glm45"])
    assert plan.parser.name == "glm45" and plan.parser.tools == [BOOKING, TIME]
    both = plan.parser.format_calls([ToolCall("book", '{"code": "a", "nights": 1}'),
                                     ToolCall("get_time", '{"zone": "Z"}')])
    assert _accepts(plan.forced_ebnf, both)
