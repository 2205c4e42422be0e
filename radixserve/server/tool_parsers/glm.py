"""GLM-4.5 / 4.6 (`glm45`) and GLM-4.7 (`glm47`) tool calls: per call

  <tool_call>NAME
  <arg_key>KEY</arg_key>
  <arg_value>VALUE</arg_value>
  ...
  </tool_call>

(GLM-4.7 writes the same without the newlines). A value is the argument's text where the
tool's schema says the parameter is a string, else JSON (`tojson` in the chat template); the
parser turns the pairs into the JSON object OpenAI's `function.arguments` holds, reading each
value by its parameter's schema (the request's tools, `ToolCallParser.tools`): a string
parameter keeps its text, any other value is read as JSON where it parses, else kept as text.

The scan reads blanks around the tags loosely. A call is reported once its name is complete
(followed by a newline or a tag); its arguments' text grows one complete pair at a time
(`{"a": 1, "b": "x"`, closed by "}" at `</tool_call>`), so what a stream sent is always a
prefix of the finished text. Text after `<tool_call>` that is not a name (blanks inside, a
tag) is plain content where it is the first call. A forced call's grammar writes the pairs
in the schema's property order, the required ones always, the others optionally
(`argument_pairs`); a string value there may hold any text without its end tag
(grammar.text_without)."""
from __future__ import annotations

import json
from typing import Any

from radixserve.server.partial_text import skip_blanks
from radixserve.server.tool_parsers.base import PartialCall, Scan, ToolCall, ToolCallParser

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
KEY_BEGIN, KEY_END = "<arg_key>", "</arg_key>"
VALUE_BEGIN, VALUE_END = "<arg_value>", "</arg_value>"
MARKERS = (CALL_BEGIN, CALL_END, KEY_BEGIN, KEY_END, VALUE_BEGIN, VALUE_END)


class Glm45Parser(ToolCallParser):
    name = "glm45"
    marker = CALL_BEGIN
    markers = MARKERS
    grammar_between = "\n"  # between two calls of one answer, as the template writes them
    _newline = "\n"  # after the name and after each pair

    def scan(self, text: str, final: bool = False) -> Scan:
        content_end, pos = self.section_start(text, final)
        scan = Scan(content_end)
        while True:
            begun = self._call_begin(text, skip_blanks(text, pos))
            if begun is None:
                break  # the answer's end, an unfinished tag or something else
            name, pos = begun
            if name is None:
                if pos < 0 and not scan.calls:  # not a call: plain text, as parse() has it
                    scan.content_end = len(text)
                break
            pairs, pos, complete = self._pairs(name, text, pos)
            body = "{" + ", ".join(pairs)
            scan.calls.append(PartialCall(name, body + "}" if complete else body, complete))
            if not complete:
                break
        return scan

    def _call_begin(self, text: str, pos: int) -> tuple[str | None, int] | None:
        """None where no call begins at `pos`; else the call's name and where it ends, as
        `_name` gives them ((None, pos) unfinished, (None, -1) no name)."""
        if not text.startswith(CALL_BEGIN, pos):
            return None
        return _name(text, pos + len(CALL_BEGIN))

    def _pairs(self, name: str, text: str, pos: int) -> tuple[list[str], int, bool]:
        """The complete `"key": value` texts of the call whose name ends at `pos`, where its
        text so far ends, and whether the call is complete."""
        pairs: list[str] = []
        while True:
            pos = skip_blanks(text, pos)
            if text.startswith(CALL_END, pos):
                return pairs, pos + len(CALL_END), True
            key, after = _between(text, pos, KEY_BEGIN, KEY_END)
            if key is None:
                return pairs, pos, False
            value, after = _between(text, skip_blanks(text, after), VALUE_BEGIN, VALUE_END)
            if value is None:
                return pairs, pos, False
            key = key.strip()
            pairs.append(self._pair_text(name, key, value))
            pos = after

    def _pair_text(self, function: str, key: str, value: str) -> str:
        """`"key": value` of the arguments' JSON text, the value read by `_value`."""
        return f"{json.dumps(key, ensure_ascii=False)}: " \
            f"{json.dumps(self._value(function, key, value), ensure_ascii=False)}"

    def _value(self, function: str, key: str, text: str) -> Any:
        """An argument's value as its parameter's schema reads it (see the module's text)."""
        if is_text_parameter(_parameter_schema(self.tools, function, key)):
            return text
        return json_or_text(text)

    def format_calls(self, calls: list[ToolCall]) -> str:
        return self.grammar_between.join(self._call_text(c.name, json.loads(c.arguments))
                                         for c in calls)

    def _call_text(self, name: str, arguments: dict[str, Any]) -> str:
        before, after = self.call_literals(name)
        key_before, key_after, value_after = self.argument_pairs()
        pairs = "".join(
            f"{key_before}{key}{key_after}"
            f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}"
            f"{value_after}" for key, value in arguments.items())
        return f"{before}{pairs}{after}"

    def wrap_call(self, call_json: str) -> str:
        call = json.loads(call_json)
        return self._call_text(call["name"], call["arguments"])

    def grammar_parts(self) -> tuple[str, str]:
        return "", ""

    def call_literals(self, name: str) -> tuple[str, str]:
        return f"{CALL_BEGIN}{name}{self._newline}", CALL_END

    def argument_pairs(self) -> tuple[str, str, str]:
        return KEY_BEGIN, f"{KEY_END}{self._newline}{VALUE_BEGIN}", f"{VALUE_END}{self._newline}"


class Glm47Parser(Glm45Parser):
    name = "glm47"
    grammar_between = ""
    _newline = ""


def _name(text: str, pos: int) -> tuple[str | None, int]:
    """(name, where it ends) of the call whose begin tag ends at `pos`: the text up to the
    first newline or tag. (None, pos) while unfinished; (None, -1) where it is not a name."""
    end = len(text)
    for stop in ("\n", "<"):
        found = text.find(stop, pos)
        end = found if 0 <= found < end else end
    if end == len(text):
        return None, pos
    name = text[pos:end].strip()
    if not name or any(c.isspace() for c in name):
        return None, -1
    return name, end


def json_or_text(text: str) -> Any:
    """A non-string argument's value: its JSON where it parses, else its text."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


def _between(text: str, pos: int, begin: str, end: str) -> tuple[str | None, int]:
    """(the text between `begin` at `pos` and the next `end`, past that end); None where the
    text there is not `begin` or the end has not come yet."""
    if not text.startswith(begin, pos):
        return None, pos
    start = pos + len(begin)
    stop = text.find(end, start)
    return (None, pos) if stop < 0 else (text[start:stop], stop + len(end))


def is_text_parameter(schema: Any) -> bool:
    """Whether the chat template writes this parameter's values as their text: a string
    parameter (also a nullable one: "string" among its types, or in its anyOf / oneOf), or
    one whose `enum` / `const` values are all strings."""
    if not isinstance(schema, dict):
        return False
    kinds = schema.get("type")
    if kinds == "string" or (isinstance(kinds, list) and "string" in kinds):
        return True
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and any(is_text_parameter(o) for o in options):
            return True
    values = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
    return bool(values) and all(isinstance(v, str) for v in values)


def _parameter_schema(tools: list[dict[str, Any]], function: str, key: str) -> Any:
    for tool in tools:
        spec = tool.get("function") or {}
        if spec.get("name") == function:
            properties = (spec.get("parameters") or {}).get("properties") or {}
            return properties.get(key)
    return None

