"""MiniMax-M2 / M2.1 / M2.5 tool calls (`minimax_m2`): one or more invokes in a block,

  <minimax:tool_call>
  <invoke name="NAME">
  <parameter name="KEY">VALUE</parameter>
  ...
  </invoke>
  </minimax:tool_call>

Values are written as glm.py's: a string parameter's value is its text, any other is JSON
(read as JSON where it parses, else kept as text, by the request's tools' schemas). A string
value loses one newline on each side (the model may put the text on lines of its own); other
values are read stripped. The scan reads as loosely as vLLM's parsers: a value ends at its
`</parameter>` where the next tag follows it (an end tag that other text follows, as inside a
JSON value that holds one, is the value's text) or, the end tag left out, at the next
parameter or the invoke's end; an invoke left open ends at the block's end. Names may be
quoted with " or ' or not at all. A stream reports a
call once its name's tag is complete and grows its arguments one complete parameter at a
time, as glm.py's does. A forced call's grammar writes the block around the invokes and one
parameter per property in the schema's order."""
from __future__ import annotations

import json
from typing import Any

from radixserve.server.partial_text import skip_blanks
from radixserve.server.tool_parsers.base import ToolCall
from radixserve.server.tool_parsers.glm import (Glm45Parser, _parameter_schema,
                                               is_text_parameter, json_or_text)

BLOCK_BEGIN, BLOCK_END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE_BEGIN, INVOKE_END = "<invoke name=", "</invoke>"
PARAM_BEGIN, PARAM_END = "<parameter name=", "</parameter>"


class MiniMaxM2Parser(Glm45Parser):
    name = "minimax_m2"
    marker = BLOCK_BEGIN
    markers = (BLOCK_BEGIN, BLOCK_END, INVOKE_BEGIN, INVOKE_END, PARAM_BEGIN, PARAM_END)
    grammar_between = ""  # each invoke's literal text ends with its newline
    # the tags (Qwen3-Coder's format has the same structure under other tags)
    block_tags = (BLOCK_BEGIN, BLOCK_END)
    invoke_tags = (INVOKE_BEGIN, INVOKE_END)
    param_tags = (PARAM_BEGIN, PARAM_END)

    def _call_begin(self, text: str, pos: int) -> tuple[str | None, int] | None:
        while True:  # blocks open and close around invokes, one or several
            tag = next((t for t in self.block_tags if text.startswith(t, pos)), None)
            if tag is None:
                break
            pos = skip_blanks(text, pos + len(tag))
        invoke = self.invoke_tags[0]
        if not text.startswith(invoke, pos):
            rest = text[pos:]
            if rest and not invoke.startswith(rest) and \
                    not any(t.startswith(rest) for t in self.block_tags):
                return None, -1  # no invoke can begin here: the block tag was plain text
            return None
        return tag_name(text, pos + len(invoke))

    def _pairs(self, name: str, text: str, pos: int) -> tuple[list[str], int, bool]:
        """The complete `"key": value` texts of the invoke whose name tag ends at `pos`,
        where its text so far ends, and whether the invoke is complete (its end tag, or the
        block's where the model left the invoke's out)."""
        pairs: list[str] = []
        invoke_end, block_end = self.invoke_tags[1], self.block_tags[1]
        param_begin = self.param_tags[0]
        while True:
            pos = skip_blanks(text, pos)
            if text.startswith(invoke_end, pos):
                return pairs, pos + len(invoke_end), True
            if text.startswith(block_end, pos):
                return pairs, pos, True
            if not text.startswith(param_begin, pos):
                return pairs, pos, False
            key, after = tag_name(text, pos + len(param_begin))
            ends = self._value_end(text, after) if key is not None else None
            if key is None or ends is None:
                return pairs, pos, False
            pairs.append(self._pair_text(name, key, text[after:ends[0]]))
            pos = ends[1]

    def _value_end(self, text: str, start: int) -> tuple[int, int] | None:
        """(where the value from `start` ends, where the scan goes on), None while it has not
        ended: at a parameter end tag followed by the next parameter's tag or the invoke's or
        block's end (blanks between; an end tag that other text follows is the value's own
        text), or at one of those tags itself (the end tag left out), as vLLM reads them."""
        param_end = self.param_tags[1]
        after_value = (self.param_tags[0], self.invoke_tags[1], self.block_tags[1])
        pos = start
        while True:
            found = [(at, tag) for tag in (param_end, *after_value)
                     if (at := text.find(tag, pos)) >= 0]
            if not found:
                return None
            at, tag = min(found)
            if tag != param_end:
                return at, at
            after = skip_blanks(text, at + len(param_end))
            rest = text[after:]
            if any(rest.startswith(t) for t in after_value):
                return at, after
            if any(t.startswith(rest) for t in after_value):  # unfinished: wait for more
                return None
            pos = at + len(param_end)

    def _value(self, function: str, key: str, text: str) -> Any:
        if is_text_parameter(_parameter_schema(self.tools, function, key)):
            return text.removeprefix("\n").removesuffix("\n")
        return self.read_non_text(text.strip())

    # a non-string parameter's value (Qwen3-Coder's also takes Python literals)
    read_non_text = staticmethod(json_or_text)

    def format_calls(self, calls: list[ToolCall]) -> str:
        invokes = "".join(self._call_text(c.name, json.loads(c.arguments)) for c in calls)
        before, after = self.grammar_parts()
        return f"{before}{invokes}{after}"

    def wrap_call(self, call_json: str) -> str:
        call = json.loads(call_json)
        before, after = self.grammar_parts()
        return f"{before}{self._call_text(call['name'], call['arguments'])}{after}"

    def grammar_parts(self) -> tuple[str, str]:
        return f"{BLOCK_BEGIN}\n", BLOCK_END

    def call_literals(self, name: str) -> tuple[str, str]:
        return f'{INVOKE_BEGIN}"{name}">\n', f"{INVOKE_END}\n"

    def argument_pairs(self) -> tuple[str, str, str]:
        return f'{PARAM_BEGIN}"', '">', f"{PARAM_END}\n"


def tag_name(text: str, pos: int) -> tuple[str | None, int]:
    """(name, past the tag's ">") of a tag whose `name=` ends at `pos`: a quoted name holds
    anything but its quote, an unquoted one no blank, quote or "<". (None, pos) while the tag
    is unfinished; (None, -1) where what stands there is no name."""
    pos = skip_blanks(text, pos)
    if pos < len(text) and text[pos] in "\"'":
        close = text.find(text[pos], pos + 1)
        end = skip_blanks(text, close + 1) if close >= 0 else len(text)
        if end >= len(text):
            return None, pos
        name = text[pos + 1:close]
        return (name, end + 1) if name and text[end] == ">" else (None, -1)
    end = text.find(">", pos)
    if end < 0:
        return None, pos
    name = text[pos:end].strip()
    if not name or any(c.isspace() or c in "<\"'" for c in name):
        return None, -1
    return name, end + 1
