"""What every tool-call format shares: the model writes plain content, then a tool-call
section that starts with a marker and holds one JSON object per call,
{"name": ..., "arguments" (or "parameters"): {...}}, between the format's wrapper text.

`ToolCallParser.scan(text)` reads a possibly unfinished output: where the plain content ends
(text that could still become a marker is held back) and each call so far, with its name once
the name's string is complete and the raw JSON text of its arguments as far as it is
certain. `parse` is the finished output's scan. A subclass gives the marker, how to find the
section, the wrapper of one call (for grammars and for rendering history) and the system
prompt for chat templates that do not render tools. A format whose calls are not JSON objects
(deepseek.py, glm.py) overrides `scan` and `format_calls`, and gives its forced-call grammar's
literals (`call_literals`, and `argument_pairs` for arguments written as key / value pairs).
A parser is made per request, with the request's tools."""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.partial_text import held_back

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_BETWEEN_CALLS = " \t\r\n,;[]"


@dataclass
class PartialCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # raw JSON text of the arguments, as far as it is certain
    complete: bool


@dataclass
class Scan:
    content_end: int  # text[:content_end] is plain content
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text (OpenAI's function.arguments)


class ToolCallParser(ABC):
    name: str = ""
    marker: str = ""  # the text that opens the tool-call section
    wrappers: tuple[str, ...] = ()  # text between calls the scan skips

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        """tools: the request's (OpenAI tool dicts), for formats that read an argument by its
        parameter's schema (glm.py)."""
        self.tools = tools or []

    def section_start(self, text: str, final: bool) -> tuple[int, int]:
        """(content_end, calls_start): where plain content ends and where the calls begin
        (len(text) for both when there is no tool-call section). By default the section
        starts at the marker; while the output is unfinished, a tail that could be the
        marker's beginning is not content yet."""
        start = text.find(self.marker)
        if start >= 0:
            return start, start
        end = len(text) if final else len(text) - held_back(text, self.marker)
        return end, len(text)

    @abstractmethod
    def wrap_call(self, call_json: str) -> str:
        """The text of one call in this format (for history rendering)."""

    @abstractmethod
    def grammar_parts(self) -> tuple[str, str]:
        """(before, after): literal text around the calls a forced call writes; each call
        object is {"name": ..., <arguments_key>: {...}}."""

    arguments_key: str = "arguments"
    # literal text between two calls of one answer in a forced call's grammar (parallel tool
    # calls); None where the format holds one call per message
    grammar_between: str | None = None

    markers: tuple[str, ...] = ()  # all the format's tags, where it has more than `marker`
    # key / value formats (`argument_pairs`): a string argument is written as bare text (GLM,
    # MiniMax, Qwen3-Coder); False: as a quoted literal (pythonic calls)
    text_values: bool = True
    # key / value formats: text between two pairs (and none after the last) of a forced call,
    # whose pairs then come required first (pythonic calls: ", "); None: `argument_pairs`'
    # own literals after every pair
    pair_separator: str | None = None

    @property
    def special_markers(self) -> tuple[str, ...]:
        """The format's marker texts that may be special tokens of the model's vocabulary: a
        request whose output is parsed keeps those that are (skip_special_tokens would drop
        them, and the calls with them)."""
        return self.markers or ((self.marker,) if self.marker else ())

    def call_literals(self, name: str) -> tuple[str, str] | None:
        """For a forced call's grammar of a format whose calls are not JSON objects: (before,
        after), the literal text around the arguments (the tool's parameters schema, as JSON)
        of one call of function `name`. None (the default): each call is the JSON object
        {"name": ..., <arguments_key>: {...}}."""
        return None

    def argument_pairs(self) -> tuple[str, str, str] | None:
        """For a format that writes each argument as a key / value pair (glm.py): the literals
        (before the key, between key and value, after the value) of a forced call's grammar,
        whose `call_literals` then surround the pairs. None (the default): the arguments are
        one JSON object."""
        return None

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Instructions for chat templates that ignore `tools`."""
        example = self.wrap_call(json.dumps({"name": "<function-name>",
                                             self.arguments_key: {"<arg>": "<value>"}}))
        specs = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        return ("You may call functions. The available functions, one JSON object a line:\n"
                f"{specs}\nTo call one, answer with exactly:\n{example}")

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(self.wrap_call(json.dumps(
            {"name": c.name, self.arguments_key: json.loads(c.arguments)})) for c in calls)

    def parse(self, text: str, keep_unfinished: bool = False) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished output; a call without a complete name is dropped,
        and so is an unfinished one unless `keep_unfinished` (an output max_tokens cut: the
        calls as a stream of it sent them, the last one's arguments as far as they got). The
        content ends where the first call with a name begins, finished or not."""
        scan = self.scan(text, final=True)
        calls = [ToolCall(c.name, c.arguments or ("{}" if c.complete else ""))
                 for c in scan.calls
                 if c.name is not None and (c.complete or keep_unfinished)]
        if not calls and not any(c.name is not None for c in scan.calls):
            return text, []  # no call begun: the marker's text is content
        # a call begun (its name read) and left unfinished is not content either, as a
        # stream, which sent its name, has it
        return text[:scan.content_end].rstrip(), calls

    def scan(self, text: str, final: bool = False) -> Scan:
        content_end, pos = self.section_start(text, final)
        scan = Scan(content_end)
        while pos < len(text):
            pos = self._skip_wrappers(text, pos)
            if pos >= len(text) or text[pos] != "{":
                break
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                scan.calls.append(_partial_call(text[pos:]))
                break
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                break
            scan.calls.append(PartialCall(obj["name"], _arguments_text(text[pos:end], obj), True))
            pos = end
        return scan

    def _skip_wrappers(self, text: str, pos: int) -> int:
        while pos < len(text):
            wrapper = next((w for w in self.wrappers if text.startswith(w, pos)), None)
            if wrapper is not None:
                pos += len(wrapper)
            elif text[pos] in _BETWEEN_CALLS:
                pos += 1
            else:
                return pos
        return pos


def _arguments_text(call_text: str, obj: dict[str, Any]) -> str:
    """The raw JSON text of a complete call's arguments (a JSON string's content when the
    model wrote the arguments as a string)."""
    value = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(value, str):
        return value
    match = _ARGS.search(call_text)
    if match is None:
        return json.dumps(value)
    _, end = _DECODER.raw_decode(call_text, match.end())
    return call_text[match.end():end]


def _partial_call(call_text: str) -> PartialCall:
    """An unfinished call object: its name once complete, its arguments' text so far (all of
    it when the arguments value is itself complete, else up to trailing whitespace; a string
    value is held until complete)."""
    name_match = _NAME.search(call_text)
    args_match = _ARGS.search(call_text)
    if name_match is not None and args_match is not None and \
            name_match.start() > args_match.start():
        # the arguments come first: a "name" inside them is not the call's; the call's
        # follows the arguments' complete value
        try:
            _, end = _DECODER.raw_decode(call_text, args_match.end())
        except json.JSONDecodeError:
            name_match = None
        else:
            name_match = _NAME.search(call_text, end)
    name = json.loads(f'"{name_match.group(1)}"') if name_match else None
    arguments = ""
    if args_match is not None and name is not None and args_match.start() > name_match.end():
        rest = call_text[args_match.end():]
        try:
            value, end = _DECODER.raw_decode(rest)
            arguments = value if isinstance(value, str) else rest[:end]
        except json.JSONDecodeError:
            arguments = "" if rest.startswith('"') else rest.rstrip()
    return PartialCall(name, arguments, False)
