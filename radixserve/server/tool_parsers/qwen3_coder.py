"""Qwen3-Coder's tool calls (`qwen3_coder`: Qwen3-Coder, Qwen3.5, Nemotron-3-Nano), a block per
call:

  <tool_call>
  <function=NAME>
  <parameter=KEY>
  VALUE
  </parameter>
  ...
  </function>
  </tool_call>

MiniMax-M2's structure under other tags, read as loosely (minimax.py: a value ends at its
`</parameter>` where a tag follows that, else the text is the value's, or, the end tag left
out, at the next `<parameter=` or `</function>`; a function left open ends at `</tool_call>`).
A string parameter's value is its text less one newline on each side; any
other is read stripped as JSON, else as the Python literal the template writes for non-string
values (True, None, {'k': 1}), else kept as text (by the request's tools' schemas). Names are
unquoted. A stream reports a call once its function tag is complete and grows its arguments
one complete parameter at a time. A forced call's grammar writes each call in its own block,
as the chat template does. A call whose `<tool_call>` the model left out (a bare
`<function=NAME>` opening a line) is read too, as vLLM's parser reads it."""
from __future__ import annotations

import ast
from typing import Any

from radixserve.server.partial_text import held_back
from radixserve.server.tool_parsers.glm import CALL_BEGIN, CALL_END, Glm45Parser, json_or_text
from radixserve.server.tool_parsers.minimax import MiniMaxM2Parser

FUNCTION_BEGIN, FUNCTION_END = "<function=", "</function>"
PARAM_BEGIN, PARAM_END = "<parameter=", "</parameter>"


def json_or_literal(text: str) -> Any:
    """A non-string value: JSON, else a Python literal (True / False / None, {'k': 1}), else
    its text."""
    value = json_or_text(text)
    if value is not text:  # it parsed as JSON
        return value
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
        return text


def _opens_line(text: str, pos: int) -> bool:
    return not text[text.rfind("\n", 0, pos) + 1:pos].strip()


def _bare_function(text: str) -> int:
    """Where the first `<function=` that opens a line (after blanks) is, else -1."""
    pos = text.find(FUNCTION_BEGIN)
    while pos >= 0 and not _opens_line(text, pos):
        pos = text.find(FUNCTION_BEGIN, pos + 1)
    return pos


class Qwen3CoderParser(MiniMaxM2Parser):
    name = "qwen3_coder"
    marker = CALL_BEGIN
    markers = (CALL_BEGIN, CALL_END, FUNCTION_BEGIN, FUNCTION_END, PARAM_BEGIN, PARAM_END)
    grammar_between = "\n"
    block_tags = (CALL_BEGIN, CALL_END)
    invoke_tags = (FUNCTION_BEGIN, FUNCTION_END)
    param_tags = (PARAM_BEGIN, PARAM_END)
    # one block per call: GLM's joining of whole calls, not MiniMax's one block around all
    format_calls = Glm45Parser.format_calls
    wrap_call = Glm45Parser.wrap_call
    grammar_parts = Glm45Parser.grammar_parts
    read_non_text = staticmethod(json_or_literal)

    def section_start(self, text: str, final: bool) -> tuple[int, int]:
        """At the first `<tool_call>`, or bare `<function=` opening a line (mid-line it is
        prose); while the output grows, a tail that may become either is held back."""
        starts = [at for at in (text.find(CALL_BEGIN), _bare_function(text)) if at >= 0]
        if starts:
            return min(starts), min(starts)
        held = held_back(text, CALL_BEGIN)
        tail = held_back(text, FUNCTION_BEGIN)
        if tail and _opens_line(text, len(text) - tail):
            held = max(held, tail)
        return (len(text) if final else len(text) - held), len(text)

    def call_literals(self, name: str) -> tuple[str, str]:
        return f"{CALL_BEGIN}\n{FUNCTION_BEGIN}{name}>\n", f"{FUNCTION_END}\n{CALL_END}"

    def argument_pairs(self) -> tuple[str, str, str]:
        return PARAM_BEGIN, ">\n", f"\n{PARAM_END}\n"
