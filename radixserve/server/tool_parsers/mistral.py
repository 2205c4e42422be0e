"""Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the marker is a special
token in Mistral's vocabularies: chat requests with tools keep it in the text,
SamplingParams.keep_special_tokens)."""
from __future__ import annotations

import json

from radixserve.server.tool_parsers.base import ToolCall, ToolCallParser


class MistralParser(ToolCallParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    wrappers = ("[TOOL_CALLS]",)
    grammar_between = ", "  # the calls are one JSON array

    def wrap_call(self, call_json: str) -> str:
        return f"[TOOL_CALLS] [{call_json}]"

    def format_calls(self, calls: list[ToolCall]) -> str:
        body = ", ".join(json.dumps({"name": c.name, "arguments": json.loads(c.arguments)})
                         for c in calls)
        return f"[TOOL_CALLS] [{body}]"

    def grammar_parts(self) -> tuple[str, str]:
        return "[TOOL_CALLS] [", "]"
