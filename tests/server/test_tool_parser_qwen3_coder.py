"""Qwen3-Coder's tool calls (tool_parsers/qwen3_coder.py: Qwen3-Coder, Qwen3.5, Nemotron-3)
beyond the shared cases of test_tool_parsers.py: the flag name, template detection and
Nemotron-3's reasoning alias, values read by the request's tools' schemas, and the forced
grammar's text."""
from __future__ import annotations

import json

from radixserve.server.reasoning import get_format, prompt_block
from radixserve.server.tool_parsers.base import ToolCall
from radixserve.server.tool_parsers.qwen3_coder import Qwen3CoderParser
from radixserve.server.tool_parsers.registry import detect_parser_name, get_parser
from tests.server.test_tool_parser_glm import (BOOKING, assert_forced_grammar_reads_the_schema,
                                               assert_values_read_by_the_tools_schemas)
from tests.server.test_tool_parsers import stream_text

# the assistant turn of Qwen3-Coder's chat template, as Qwen3.5's and Nemotron-3's write it
TEMPLATE = ("{%- for tool_call in message.tool_calls %}{{- '<tool_call>\\n<function=' + "
            "tool_call.function.name + '>\\n' }}{%- for k, v in tool_call.function.arguments"
            "|items %}{{- '<parameter=' + k + '>\\n' }}{{- v }}{{- '\\n</parameter>\\n' }}"
            "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}")


def test_flag_name_template_detection_and_reasoning_alias() -> None:
    assert type(get_parser("qwen3_coder")) is Qwen3CoderParser
    assert detect_parser_name(TEMPLATE) == "qwen3_coder"
    fmt = get_format("nano_v3")  # Nemotron-3: the prompt opens <think> when thinking is on
    assert fmt.name == "qwen3" and prompt_block(fmt, "<|im_start|>assistant\n<think>\n") == \
        "opened"


def test_values_read_by_the_tools_schemas() -> None:
    assert_values_read_by_the_tools_schemas("qwen3_coder", (
        "<tool_call>\n<function=book>\n<parameter=code>\n007\n</parameter>\n"
        "<parameter=nights>\n3\n</parameter>\n<parameter=late>\ntrue\n</parameter>\n"
        '<parameter=guest>\n{"name": "Ann"}\n</parameter>\n<parameter=note>\nnot JSON\n'
        "</parameter>\n</function>\n</tool_call>"))


def test_forced_grammar_writes_what_the_template_writes() -> None:
    call = assert_forced_grammar_reads_the_schema("qwen3_coder")
    assert call({"code": "x", "nights": 2}) == (
        "<tool_call>\n<function=book>\n<parameter=code>\nx\n</parameter>\n<parameter=nights>"
        "\n2\n</parameter>\n</function>\n</tool_call>")


def test_nullable_string_parameters_keep_their_text() -> None:
    """Optional[str] (anyOf string / null, or a list of types): the value's text, its inner
    blanks kept, not read as JSON."""
    tool = {"type": "function", "function": {"name": "edit", "parameters": {
        "type": "object", "properties": {
            "old": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "new": {"type": ["string", "null"]}, "line": {"type": "integer"}}}}}
    text = ("<tool_call>\n<function=edit>\n<parameter=old>\n42\n</parameter>\n"
            "<parameter=new>\n    indented\n</parameter>\n<parameter=line>\n7\n"
            "</parameter>\n</function>\n</tool_call>")
    _, calls = get_parser("qwen3_coder", None, [tool]).parse(text)
    assert json.loads(calls[0].arguments) == {"old": "42", "new": "    indented", "line": 7}


def test_a_stray_block_tag_in_prose_streams_as_content() -> None:
    """Once what follows `<tool_call>` cannot be a function tag, the text is content and the
    stream sends it then, not at the end."""
    from radixserve.server.tool_parsers.streaming import ToolCallStream
    text = "Use <tool_call> tags, then the function tag. More text follows here."
    stream = ToolCallStream(get_parser("qwen3_coder"))
    sent, _ = stream.update(text[:30], final=False)
    rest, deltas = stream.update(text, final=True)
    assert sent.startswith("Use <tool_call> tags") and sent + rest == text and not deltas


def test_a_bare_function_tag_opening_a_line_is_a_call() -> None:
    """The model left `<tool_call>` out (vLLM reads such calls too): the call is parsed and
    streamed alike; `<function=` inside a line of prose stays content."""
    text = ("Sure.\n<function=book>\n<parameter=code>\nx</y\n</parameter>\n"
            "<parameter=nights>\n2\n</parameter>\n</function>")
    expected = [ToolCall("book", '{"code": "x</y", "nights": 2}')]
    assert get_parser("qwen3_coder", None, [BOOKING]).parse(text) == ("Sure.", expected)
    for chunk in (1, 4):
        assert stream_text("qwen3_coder", text, chunk, [BOOKING]) == (
            "Sure.", [("book", '{"code": "x</y", "nights": 2}')], True)
    prose = "Write <function=book> to call it."
    assert get_parser("qwen3_coder", None, [BOOKING]).parse(prose) == (prose, [])
    assert stream_text("qwen3_coder", prose, 1, [BOOKING]) == (prose, [], False)
