"""Pythonic tool calls (Llama-3.2's and Llama-4's, vLLM's `pythonic` / `llama4_pythonic`):
the whole answer is a Python list of calls with keyword arguments,

  [get_weather(city="Paris", days=3), get_time(zone='CET')]

optionally between Llama-4's `<|python_start|>` and `<|python_end|>`. Values are Python
literals (strings in either quotes, numbers, True / False / None, lists, dicts, tuples); JSON's
true / false / null are read too. An answer whose first non-blank text is not `[` (after the
optional tag) is plain content.

The scan reads the list by hand, so an unfinished answer gives its calls so far: a call is
reported once `name(` is written; its arguments' JSON text grows one complete `key=value` at a
time (`{"city": "Paris", "days": 3`, closed by "}" at the call's `)`), so what a stream sent is
always a prefix of the finished text. A forced call's grammar writes `[name(key=value, ...)]`
with each value as JSON of its parameter's schema (valid Python but for true / false / null,
which the scan reads), the required arguments first, then any of the optional ones."""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from radixserve.server.partial_text import held_back, skip_blanks
from radixserve.server.tool_parsers.base import PartialCall, Scan, ToolCall, ToolCallParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_IDENTIFIER = re.compile(r"[A-Za-z_][\w.\-]*")
_KEY = re.compile(r"([A-Za-z_]\w*)\s*=")
_JSON_NAMES = {"true": True, "false": False, "null": None}
_CLOSING = {"(": ")", "[": "]", "{": "}"}


class PythonicParser(ToolCallParser):
    name = "pythonic"
    marker = "["
    markers = (PYTHON_START, PYTHON_END)
    wrappers = (PYTHON_START, PYTHON_END)
    grammar_between = ", "  # the calls are one Python list
    text_values = False  # a string argument is a quoted literal, not bare text

    def section_start(self, text: str, final: bool) -> tuple[int, int]:
        start = skip_blanks(text, 0)
        if text.startswith(PYTHON_START, start):
            return start, start
        if text.startswith("[", start):
            return 0, start
        if start == len(text) and not final:
            return 0, len(text)  # nothing but blanks yet: could still become a call
        end = len(text) if final else len(text) - held_back(text, PYTHON_START, "[")
        return end, len(text)

    def scan(self, text: str, final: bool = False) -> Scan:
        content_end, pos = self.section_start(text, final)
        scan = Scan(content_end)
        if pos >= len(text):
            return scan
        pos = skip_blanks(text, pos + len(PYTHON_START)) \
            if text.startswith(PYTHON_START, pos) else pos
        if not text.startswith("[", pos):
            if pos < len(text) or final:  # the tag and then no list: plain content
                scan.content_end = len(text)
            return scan
        pos += 1
        while True:
            pos = skip_blanks(text, pos)
            name_match = _IDENTIFIER.match(text, pos)
            if name_match is None or not text.startswith("(", skip_blanks(text, name_match.end())):
                if not scan.calls and _no_call(text, pos, name_match):
                    scan.content_end = len(text)  # "[" and then no call: a plain answer
                break
            name = name_match.group(0)
            pairs, pos, complete = _arguments(text, skip_blanks(text, name_match.end()) + 1)
            body = "{" + ", ".join(pairs)
            scan.calls.append(PartialCall(name, body + "}" if complete else body, complete))
            if not complete:
                break
            pos = skip_blanks(text, pos)
            if not text.startswith(",", pos):
                break  # "]", the end, or anything else ends the list
            pos += 1
        return scan

    def wrap_call(self, call_json: str) -> str:
        call = json.loads(call_json)
        return f"[{_call_text(call['name'], call.get(self.arguments_key) or {})}]"

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "[" + ", ".join(_call_text(c.name, json.loads(c.arguments or "{}"))
                               for c in calls) + "]"

    def grammar_parts(self) -> tuple[str, str]:
        return "[", "]"

    def call_literals(self, name: str) -> tuple[str, str] | None:
        return f"{name}(", ")"

    pair_separator = ", "

    def argument_pairs(self) -> tuple[str, str, str] | None:
        return "", "=", ""

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        specs = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        return ("You may call functions. The available functions, one JSON object a line:\n"
                f"{specs}\nTo call them, answer with nothing but a Python list of calls with "
                "keyword arguments, e.g.\n[function_name(argument=\"value\")]")


def _no_call(text: str, pos: int, name_match: "re.Match[str] | None") -> bool:
    """The text at `pos` (after "[" or a call's ",") can no longer begin a call: a name then
    anything but "(", or anything but a name or "]"; False while the text ends where it still
    could."""
    if name_match is None:
        return pos < len(text) and text[pos] != "]"
    return skip_blanks(text, name_match.end()) < len(text)


def _call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call as Python source: name(key=literal, ...)."""
    return f"{name}(" + ", ".join(f"{key}={_python(value)}"
                                  for key, value in arguments.items()) + ")"


def _python(value: Any) -> str:
    """A JSON value as a Python literal, strings in double quotes (as JSON writes them, so a
    forced call's grammar takes them too)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_python(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return repr(value)
    return json.dumps(value)


def _arguments(text: str, pos: int) -> tuple[list[str], int, bool]:
    """The call's complete `"key": value` JSON pairs from `pos` (after its "("), the position
    after the call's ")" or where reading stopped, and whether the call is complete."""
    pairs: list[str] = []
    while True:
        pos = skip_blanks(text, pos)
        if text.startswith(")", pos):
            return pairs, pos + 1, True
        key = _KEY.match(text, pos)
        if key is None:
            return pairs, pos, False  # unfinished, or not keyword arguments
        end = _value_end(text, skip_blanks(text, key.end()))
        if end is None:
            return pairs, pos, False
        value = _literal(text[skip_blanks(text, key.end()):end])
        pairs.append(f"{json.dumps(key.group(1))}: {json.dumps(value)}")
        pos = skip_blanks(text, end)
        if text.startswith(",", pos):
            pos += 1
        elif not text.startswith(")", pos):
            return pairs, pos, False


def _value_end(text: str, pos: int) -> int | None:
    """Where the literal starting at `pos` ends (a "," or ")" outside brackets and quotes
    follows it); None where the text ends first."""
    stack: list[str] = []
    quote = ""
    i = pos
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif char in "\"'":
            quote = char * 3 if text.startswith(char * 3, i) else char
            i += len(quote) - 1
        elif char in _CLOSING:
            stack.append(_CLOSING[char])
        elif stack and char == stack[-1]:
            stack.pop()
        elif not stack and char in ",)":
            return i if text[pos:i].strip() else None
        i += 1
    return None


def _literal(source: str) -> Any:
    """A Python literal's value as JSON takes it (tuples as lists); JSON's true / false / null
    where the model wrote those; anything else unreadable as its text."""
    source = source.strip()
    if source in _JSON_NAMES:
        return _JSON_NAMES[source]
    try:
        value = ast.literal_eval(source)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        try:
            return json.loads(source)
        except ValueError:
            return source
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):  # sets, bytes, complex numbers: their text
        return source
