"""DeepSeek-V3 / R1 (0324, R1-0528) and V3.1 tool calls, in markers of DeepSeek's vocabulary
(full-width bars, U+2581 for the spaces):

- V3 / R1 (`deepseek_v3`): `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
  (the template puts a newline between two calls), then `<｜tool▁calls▁end｜>`;
- V3.1 (`deepseek_v31`): per call
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` in the same section, the
  calls chained without a separator.

Content may come before the section; blanks around the markers are read too. The arguments
are a raw JSON object (not a JSON string): a call is reported once its arguments open with
"{" (a section whose first call's arguments open with anything else is plain content, streamed
or not), and is complete once that object is (its closing
literals are skipped where they follow, as hermes' `</tool_call>`), and its text streams as
far as it is certain. The markers are special tokens where the tokenizer marks them so:
requests with tools keep all five in the text (`special_markers`,
SamplingParams.keep_special_tokens). A forced call's grammar is the section's markers around,
per call, the literal prefix with the tool's name, its parameters schema and the closing
literals (`call_literals`), the calls separated as the template separates them."""
from __future__ import annotations

import json

from radixserve.server.partial_text import skip_blanks
from radixserve.server.tool_parsers.base import PartialCall, Scan, ToolCall, ToolCallParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
MARKERS = (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END)
_FENCE = "```"
_DECODER = json.JSONDecoder()
_MORE = -1  # _take: the text ends inside the literal expected
# where an unfinished (or malformed) arguments text stops being certain: a raw newline before
# a fence is never inside JSON, and a call's end marker is almost never in a string
_UNCERTAIN_FROM = ("\n" + _FENCE, CALL_END)


class _DeepSeekParser(ToolCallParser):
    marker = CALLS_BEGIN
    markers = MARKERS
    grammar_between = ""  # between two calls of one section, as the format's template writes

    def _call_text(self, name: str, arguments: str) -> str:
        """One call in this format."""
        raise NotImplementedError

    def _header(self, text: str, pos: int) -> tuple[str | None, int]:
        """(name, where the arguments' JSON starts) of the call whose begin marker ends at
        `pos`; the name None while unfinished or malformed."""
        raise NotImplementedError

    def _closing(self, text: str, pos: int) -> int | None:
        """Past the call's closing literals after its arguments end at `pos` (None where they
        are unfinished or missing)."""
        pos = _take(text, skip_blanks(text, pos), CALL_END)
        return pos if pos not in (None, _MORE) else None

    def scan(self, text: str, final: bool = False) -> Scan:
        content_end, pos = self.section_start(text, final)
        scan = Scan(content_end)
        if pos >= len(text):
            return scan
        pos += len(CALLS_BEGIN)
        while True:
            pos = skip_blanks(text, pos)
            if not text.startswith(CALL_BEGIN, pos):
                break  # the section's end, an unfinished marker or something else
            name, pos = self._header(text, pos + len(CALL_BEGIN))
            if name is None:
                scan.calls.append(PartialCall(None, "", False))
                break
            if pos >= len(text):
                break  # the arguments have not started: not certain to be a call yet
            if text[pos] != "{":  # not a call of this format: plain text, as parse() has it
                if not scan.calls:
                    scan.content_end = len(text)
                break
            arguments, end = _arguments(text, pos)
            scan.calls.append(PartialCall(name, arguments, end is not None))
            after = None if end is None else self._closing(text, end)
            if after is None:
                break
            pos = after
        return scan

    def format_calls(self, calls: list[ToolCall]) -> str:
        body = (self.grammar_between or "").join(
            self._call_text(c.name, json.dumps(json.loads(c.arguments))) for c in calls)
        return f"{CALLS_BEGIN}{body}{CALLS_END}"

    def wrap_call(self, call_json: str) -> str:
        call = json.loads(call_json)
        return self.format_calls([ToolCall(call["name"], json.dumps(call["arguments"]))])

    def grammar_parts(self) -> tuple[str, str]:
        return CALLS_BEGIN, CALLS_END


class DeepSeekV3Parser(_DeepSeekParser):
    name = "deepseek_v3"
    grammar_between = "\n"

    def _call_text(self, name: str, arguments: str) -> str:
        return f"{CALL_BEGIN}function{SEP}{name}\n{_FENCE}json\n{arguments}\n{_FENCE}{CALL_END}"

    def call_literals(self, name: str) -> tuple[str, str] | None:
        return f"{CALL_BEGIN}function{SEP}{name}\n{_FENCE}json\n", f"\n{_FENCE}{CALL_END}"

    def _header(self, text: str, pos: int) -> tuple[str | None, int]:
        # the call's type ("function") up to the sep, the name up to the line's end, then
        # the fence ("```json", read loosely: "```" or none) before the arguments
        sep = text.find(SEP, pos)
        line_end = text.find("\n", sep + len(SEP)) if sep >= 0 else -1
        if line_end < 0 or "｜" in text[pos:sep]:
            return None, pos
        name = _name(text[sep + len(SEP):line_end])
        pos = skip_blanks(text, line_end)
        fence = _take(text, pos, _FENCE)
        if fence is not None and fence != _MORE:
            tag = _take(text, fence, "json")
            fence = tag if tag is not None else fence
        if fence == _MORE:
            return name, len(text)  # the arguments have not started
        return name, skip_blanks(text, pos if fence is None else fence)

    def _closing(self, text: str, pos: int) -> int | None:
        pos = skip_blanks(text, pos)
        fence = _take(text, pos, _FENCE)  # read loosely too: the end marker without it
        if fence == _MORE:
            return None
        return super()._closing(text, pos if fence is None else fence)


class DeepSeekV31Parser(_DeepSeekParser):
    name = "deepseek_v31"

    def _call_text(self, name: str, arguments: str) -> str:
        return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"

    def call_literals(self, name: str) -> tuple[str, str] | None:
        return f"{CALL_BEGIN}{name}{SEP}", CALL_END

    def _header(self, text: str, pos: int) -> tuple[str | None, int]:
        sep = text.find(SEP, pos)
        if sep < 0:
            return None, pos
        return _name(text[pos:sep]), skip_blanks(text, sep + len(SEP))


def _name(text: str) -> str | None:
    """A call's name as written, None where it is not one (empty, or text across markers)."""
    name = text.strip()
    return name if name and "｜" not in name and not any(c.isspace() for c in name) else None


def _arguments(text: str, pos: int) -> tuple[str, int | None]:
    """(arguments text, end) of the JSON object at `pos`: all of it and its end when
    complete, else the text so far as far as it is certain and None."""
    if not text.startswith("{", pos):
        return "", None  # not started yet, or not an object: nothing is certain
    try:
        _, end = _DECODER.raw_decode(text, pos)
    except (json.JSONDecodeError, RecursionError):
        partial = text[pos:]
        for stop in _UNCERTAIN_FROM:
            found = partial.find(stop)
            partial = partial if found < 0 else partial[:found]
        return partial.rstrip(), None
    return text[pos:end], end


def _take(text: str, pos: int, literal: str) -> int | None:
    """Past `literal` at `pos`; _MORE where the text ends inside it, None where it differs."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    return _MORE if literal.startswith(text[pos:]) else None

