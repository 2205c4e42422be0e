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
    """Sends what `ToolCallParser.parse` would return for the finished text: content before
    a call without its trailing whitespace, every content character when no call is begun
    (a malformed call section, no name read, is content), and "tool_calls" as the finish
    only for complete calls (a call cut off by max_tokens finishes as "length"). A call's
    name and arguments go out as they are certain, so a call that never completes has sent
    deltas (parse keeps it only for a max_tokens cut): a stream cannot take them back."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # calls past it are not sent (parallel_tool_calls false)
        self.content_sent = 0
        self.calls: list[_SentCall] = []
        self.completed = False  # a call completed: the finish is "tool_calls"

    @property
    def has_calls(self) -> bool:
        return self.completed

    def update(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) for the output text so far."""
        scan = self.parser.scan(text, final)
        calls = scan.calls[:self.max_calls]
        self.completed = self.completed or any(c.complete and c.name is not None
                                               for c in calls)
        if final and not self.calls and not any(c.name is not None for c in calls):
            content = text[self.content_sent:]  # no call begun: the rest is content
            self.content_sent = len(text)
            return content, []
        content = ""
        # whitespace before a call is not content (parse() strips it): held until text follows
        content_end = len(text[:scan.content_end].rstrip())
        if content_end > self.content_sent and not self.calls:
            content = text[self.content_sent:content_end]
            self.content_sent = content_end
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
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
