"""Llama 3.1 / 3.2 JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}`
(several separated by `;` are read too), optionally after `<|python_tag|>` (a special token:
chat requests with tools keep it in the text, SamplingParams.keep_special_tokens). An answer
whose first non-blank character is not `{` is plain content. A forced call is one call, the
format's one call per message (grammar_between stays None)."""
from __future__ import annotations

from radixserve.server.partial_text import held_back
from radixserve.server.tool_parsers.base import ToolCallParser

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    name = "llama3"
    marker = _PYTHON_TAG
    wrappers = (_PYTHON_TAG,)
    arguments_key = "parameters"

    def section_start(self, text: str, final: bool) -> tuple[int, int]:
        start = text.find(_PYTHON_TAG)
        if start >= 0:
            return start, start
        stripped = text.lstrip()
        if stripped.startswith("{"):
            return 0, len(text) - len(stripped)
        if not stripped and not final:
            return 0, len(text)  # nothing but blanks yet: could still become a call
        end = len(text) if final else len(text) - held_back(text, _PYTHON_TAG)
        return end, len(text)

    def wrap_call(self, call_json: str) -> str:
        return call_json

    def grammar_parts(self) -> tuple[str, str]:
        return "", ""
