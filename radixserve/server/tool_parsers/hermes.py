"""Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n
</tool_call>`, after optional content."""
from __future__ import annotations

from radixserve.server.tool_parsers.base import ToolCallParser


class HermesParser(ToolCallParser):
    name = "hermes"
    marker = "<tool_call>"
    wrappers = ("<tool_call>", "</tool_call>")
    grammar_between = "\n</tool_call>\n<tool_call>\n"  # one block per call

    def wrap_call(self, call_json: str) -> str:
        return f"<tool_call>\n{call_json}\n</tool_call>"

    def grammar_parts(self) -> tuple[str, str]:
        return "<tool_call>\n", "\n</tool_call>"
