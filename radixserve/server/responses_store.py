"""Responses kept in the server's memory (OpenAI's `store`, true by default) for
previous_response_id and GET / DELETE /v1/responses/{id}: each response object with the
conversation it ends (the turns before it, its input and its answer as an assistant turn:
text and tool calls; reasoning is not carried, nor instructions, as OpenAI's). The newest
MAX_STORED are kept; older ones are forgotten (a previous_response_id naming one is a 404).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

MAX_STORED = 4096


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat turn of a response's output items: its text and its function calls."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = \
            OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def response(self, response_id: str) -> dict[str, Any] | None:
        found = self._items.get(response_id)
        return None if found is None else found[0]

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        found = self._items.get(response_id)
        return None if found is None else found[1]

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
