"""Streaming tool calls: the chat handler feeds the growing output text; `ToolCallStream`
answers with the new plain content and OpenAI's tool-call deltas: a call's first delta has
its index, id, type and function name (arguments ""), the next ones argument fragments whose
concatenation is the call's arguments text."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.server.tool_parsers.base import ToolCallParser


@dataclass
class _SentCall:
    id: str
    arguments_sent: str = ""


class ToolCallStream:
    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # calls past it are not sent (parallel_tool_calls false)
        self.content_sent = 0
        self.calls: list[_SentCall] = []

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def update(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) for the output text so far."""
        scan = self.parser.scan(text, final)
        content = ""
        if scan.content_end > self.content_sent and not self.calls:
            content = text[self.content_sent:scan.content_end]
            self.content_sent = scan.content_end
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(scan.calls[:self.max_calls]):
            if call.name is None:
                break
            if index == len(self.calls):
                self.calls.append(_SentCall(new_call_id()))
                deltas.append({"index": index, "id": self.calls[index].id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self.calls[index]
            if len(call.arguments) > len(sent.arguments_sent) and \
                    call.arguments.startswith(sent.arguments_sent):
                fragment = call.arguments[len(sent.arguments_sent):]
                sent.arguments_sent = call.arguments
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return content, deltas


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
