"""MiniMax-M2 tool calls (tool_parsers/minimax.py) beyond the shared cases of
test_tool_parsers.py: the flag names, template detection and reasoning alias, values read by
the request's tools' schemas, an output cut mid-invoke (parsed and streamed), the forced
grammar's parameters, the six tags kept through the detokenizer where they are special
tokens, and tool turns through a MiniMax-like template (the arguments iterated as a mapping,
the answer's <think> opened in the prompt)."""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest

from radixserve.server.openai_chat import render_prompt
from radixserve.server.openai_common import OpenAIContext
from radixserve.server.openai_tools import tool_message
from radixserve.server.reasoning import get_format, prompt_block
from radixserve.server.tool_parsers.base import ToolCall
from radixserve.server.tool_parsers.minimax import MiniMaxM2Parser
from radixserve.server.tool_parsers.registry import detect_parser_name, get_parser
from tests.server.conftest import tokenizer_with_special_tokens
from tests.server.test_tool_parser_glm import (BOOKING, HISTORY,
                                               assert_forced_grammar_reads_the_schema,
                                               assert_values_read_by_the_tools_schemas)
from tests.server.test_tool_parsers import TIME, TWO_CALLS, WEATHER, _chat, stream_text
from tests.server.test_tool_special_tokens import _chat_params, _run

# the tool parts of MiniMax-M2's chat template, its assistant turn opening the reasoning
TEMPLATE = (
    "{% if tools %}]~!b[]~b]system\n# Tools\n<tools>\n{% for tool in tools %}<tool>"
    "{{ tool.function | tojson }}</tool>\n{% endfor %}</tools>\n[e~[\n{% endif %}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{ ']~b]user\\n' + m.content + '[e~[\\n' }}"
    "{%- elif m.role == 'assistant' -%}{{ ']~b]ai\\n' }}{% if m.content %}{{ m.content }}"
    "{% endif %}{% if m.tool_calls %}{{ '<minimax:tool_call>\\n' }}"
    "{%- for tc in m.tool_calls -%}{%- set tc = tc.function -%}"
    "{{ '<invoke name=\"' + tc.name + '\">\\n' }}{% for k, v in tc.arguments.items() %}"
    "{{ '<parameter name=\"' + k + '\">' }}{{ v if v is string else v | tojson }}"
    "{{ '</parameter>\\n' }}{% endfor %}{{ '</invoke>\\n' }}{%- endfor -%}"
    "{{ '</minimax:tool_call>' }}{% endif %}{{ '[e~[\\n' }}"
    "{%- elif m.role == 'tool' -%}{{ ']~b]tool\\n<response>' + m.content + "
    "'</response>[e~[\\n' }}{%- endif -%}{%- endfor -%}{{ ']~b]ai\\n<think>\\n' }}")


def test_flag_names_template_detection_and_reasoning() -> None:
    assert type(get_parser("minimax_m2")) is MiniMaxM2Parser
    assert type(get_parser("minimax-m2")) is MiniMaxM2Parser
    assert detect_parser_name(TEMPLATE) == "minimax_m2"
    fmt = get_format("minimax_m2")  # --reasoning-parser minimax_m2: <think> as Qwen3's
    assert fmt.name == "qwen3" and prompt_block(fmt, "]~b]ai\n<think>\n") == "opened"


def test_values_read_by_the_tools_schemas() -> None:
    """As GLM's, a non-string value read stripped."""
    assert_values_read_by_the_tools_schemas("minimax_m2", (
        '<minimax:tool_call>\n<invoke name="book">\n<parameter name="code">007</parameter>\n'
        '<parameter name="nights"> 3 </parameter>\n<parameter name="late">true</parameter>\n'
        '<parameter name="guest">{"name": "Ann"}</parameter>\n<parameter name="note">not '
        'JSON</parameter>\n</invoke>\n</minimax:tool_call>'))


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_output_cut_mid_invoke(chunk: int) -> None:
    """max_tokens cut the second parameter: no call parses and the call begun is not
    content; the cut output keeps the partial call; a stream sent the name and the first
    parameter, and the text before the block as content."""
    text = ('Booking.\n<minimax:tool_call>\n<invoke name="book">\n<parameter name="code">A'
            '</parameter>\n<parameter name="nights">3')
    parser = get_parser("minimax_m2", None, [BOOKING])
    assert parser.parse(text) == ("Booking.", [])
    assert parser.parse(text, keep_unfinished=True)[1] == [ToolCall("book", '{"code": "A"')]
    content, calls, _ = stream_text("minimax_m2", text, chunk, [BOOKING])
    assert (calls, content.strip()) == ([("book", '{"code": "A"')], "Booking.")


def test_forced_grammar_parameters() -> None:
    call = assert_forced_grammar_reads_the_schema("minimax_m2")
    assert call({"code": "x", "nights": 2}) == (
        '<minimax:tool_call>\n<invoke name="book">\n<parameter name="code">x</parameter>\n'
        '<parameter name="nights">2</parameter>\n</invoke>\n</minimax:tool_call>')


@pytest.fixture(scope="module")
def minimax_tokenizer() -> Any:
    """SmolLM2's tokenizer with MiniMax's six tool tags added as special tokens."""
    return tokenizer_with_special_tokens(MiniMaxM2Parser.markers)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_detokenized_calls_parse(minimax_tokenizer: Any, chunk: int) -> None:
    params, plan = _chat_params(minimax_tokenizer, "minimax_m2", tools=[WEATHER, TIME])
    assert params.keep_special_tokens == MiniMaxM2Parser.markers
    output = "Sure, checking." + plan.parser.format_calls(TWO_CALLS) + "<|im_end|>"
    text = "".join(_run(minimax_tokenizer, params, output, chunk))
    assert all(m in text for m in MiniMaxM2Parser.markers) and "<|im_end|>" not in text
    message, called = tool_message(plan, text)
    assert called and message["content"] == "Sure, checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [(c.name, json.loads(c.arguments))
                                                for c in TWO_CALLS]


def test_history_through_a_minimax_like_template(smollm_tokenizer: Any) -> None:
    """The calls render as the format the parser reads and read back with the request's
    tools; the prompt ends inside an opened reasoning block."""
    tokenizer = copy.copy(smollm_tokenizer)
    tokenizer.chat_template = TEMPLATE
    ctx = OpenAIContext(tokenizer_manager=SimpleNamespace(tokenizer=tokenizer),  # type: ignore
                        model_name="m", model_aliases=frozenset({"m"}))
    prompt, _, plan = render_prompt(ctx, _chat(messages=HISTORY, tools=[BOOKING]))
    assert plan.parser.name == "minimax_m2" and '"name": "book"' in prompt
    block = prompt[prompt.index("<minimax:tool_call>"):prompt.index("</minimax:tool_call>")
                   + len("</minimax:tool_call>")]
    assert block == plan.parser.format_calls([ToolCall("book", HISTORY[1]["tool_calls"][0][
        "function"]["arguments"])])
    assert json.loads(plan.parser.parse(block)[1][0].arguments) == {
        "code": "12", "nights": 2, "guest": {"name": "Ann"}}
    assert prompt.endswith("<response>booked</response>[e~[\n]~b]ai\n<think>\n")


def test_two_blocks_and_names_with_blanks() -> None:
    """Two blocks in one answer both count; a quoted name may hold blanks and ">"."""
    text = ('<minimax:tool_call>\n<invoke name="get_time">\n<parameter name="zone">UTC'
            '</parameter>\n</invoke>\n</minimax:tool_call>\n<minimax:tool_call>\n'
            '<invoke name="get_time">\n<parameter name="first name">a>b</parameter>\n'
            '<parameter name=\'x > y\'>1</parameter>\n</invoke>\n</minimax:tool_call>')
    _, calls = get_parser("minimax_m2").parse(text)
    assert [json.loads(c.arguments) for c in calls] == [{"zone": "UTC"},
                                                        {"first name": "a>b", "x > y": 1}]
