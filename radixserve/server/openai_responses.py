"""POST /v1/responses (OpenAI's Responses API) on the chat pipeline: the body becomes a chat
request (openai_responses_input.py), whose answer comes back as the Responses output items:
a `reasoning` item (with --reasoning-parser), a `message` item with one output_text part, and
a `function_call` item per tool call. A response cut by max_output_tokens is "incomplete"
(incomplete_details.reason "max_output_tokens").

Streaming sends OpenAI's event sequence: response.created, response.in_progress, then for each
item output_item.added, its deltas (reasoning_text.delta; content_part.added, output_text.delta,
output_text.done, content_part.done; function_call_arguments.delta / .done) and
output_item.done, and response.completed (or response.incomplete) with the whole response;
every event carries its type and a sequence_number.
"""
from __future__ import annotations

import contextlib
import itertools
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from radixserve.server.errors import APIError
from radixserve.server.image_inputs import fetch_images
from radixserve.server.openai_chat import (build_requests, chat_finish_reason, choice_of,
                                           logprob_content, output_text, reasoning_of)
from radixserve.server.openai_common import OpenAIContext, now_s, sse, sse_response, usage_of
from radixserve.server.openai_protocol import ChatCompletionRequest, parse_model
from radixserve.server.openai_responses_input import chat_body, input_messages, renamed
from radixserve.server.reasoning import ReasoningSplit, ReasoningStream
from radixserve.server.responses_store import ResponseStore, assistant_turn
from radixserve.server.request_state import GenerateRequest, ReqOutput
from radixserve.server.openai_tools import ToolPlan
from radixserve.server.tool_parsers.streaming import ToolCallStream


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _part(kind: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text} if kind == "reasoning" else text_part(text)


def with_status(output: list[dict[str, Any]], status: str) -> list[dict[str, Any]]:
    """A cut answer's message items are "incomplete", as OpenAI marks them."""
    if status != "incomplete":
        return output
    return [dict(item, status="incomplete") if item["type"] == "message" else item
            for item in output]


def message_item(item_id: str, text: str | None, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text, logprobs)]}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseShape:
    """The fields a response echoes from its request, its id and time, and where it is
    stored once done (`store`: the conversation it continues and its input, to which
    `done` adds its answer)."""

    def __init__(self, raw: dict[str, Any], model: str, store: ResponseStore | None = None,
                 conversation: list[dict[str, Any]] | None = None) -> None:
        self.id, self.created_at, self.model, self.raw = _id("resp"), now_s(), model, raw
        self.store, self.conversation = store, conversation or []

    def done(self, response: dict[str, Any]) -> dict[str, Any]:
        """The finished response, kept in the store (when the request asked for it)."""
        if self.store is not None:
            self.store.put(response, self.conversation + [assistant_turn(response["output"])])
        return response

    def build(self, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, reason: str | None = None) -> dict[str, Any]:
        raw = self.raw
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None,
            "incomplete_details": {"reason": reason} if reason else None,
            "instructions": raw.get("instructions"),
            "max_output_tokens": raw.get("max_output_tokens"), "model": self.model,
            "output": output, "parallel_tool_calls": raw.get("parallel_tool_calls", True),
            "previous_response_id": raw.get("previous_response_id"),
            "reasoning": {"effort": (raw.get("reasoning") or {}).get("effort"),
                          "summary": None},
            "store": self.store is not None, "temperature": raw.get("temperature"),
            "text": raw.get("text") or {"format": {"type": "text"}},
            "tool_choice": raw.get("tool_choice", "auto"), "tools": raw.get("tools") or [],
            "top_p": raw.get("top_p"), "truncation": raw.get("truncation", "disabled"),
            "usage": usage, "user": raw.get("user"), "metadata": raw.get("metadata") or {}}


def responses_usage(out: ReqOutput, reasoning_tokens: int) -> dict[str, Any]:
    usage = usage_of([out], 1)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens":
                                     usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage["total_tokens"]}


def _token_count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False)) if text and tokenizer else 0


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


async def create_response(ctx: OpenAIContext, request: Request, raw: Any) -> Response:
    tm = ctx.tokenizer_manager
    lane = await tm.lanes.lane_for(request, raw)
    history = previous_conversation(ctx.responses, raw)
    try:
        chat: ChatCompletionRequest = await tm.lanes.offload(
            lambda: parse_model(ChatCompletionRequest, chat_body(raw, history)), lane=lane)
        chat.check_unsupported()
        keep = ctx.responses if raw.get("store", True) is not False else None
        shape = ResponseShape(raw, ctx.check_model(chat.model), keep,
                              (history or []) + input_messages(raw))
        images = await fetch_images(tm.images, chat.image_sources(), "messages")
        reqs, plan, split = await tm.lanes.offload(build_requests, ctx, chat, images,
                                                   lane=lane)
    except APIError as exc:
        raise renamed(exc) from None
    if chat.stream:
        return await sse_response(stream_response(ctx, shape, chat, plan, split, reqs,
                                                  request))
    out = (await tm.generate_all(reqs, request))[0]
    choice = choice_of(chat, plan, 0, out, tm.tokenizer, split,
                       reasoning_of(ctx, chat) is not None)
    message = choice["message"]
    thought = message.get("reasoning_content") or ""
    output = [reasoning_item(_id("rs"), thought)] if thought else []
    calls = message.get("tool_calls") or []
    if message.get("content") or not (output or calls):  # an empty answer: one empty item
        logprobs = (choice["logprobs"] or {}).get("content")
        output.append(message_item(_id("msg"), message.get("content") or "",
                                   logprobs=logprobs))
    for call in calls:
        output.append(call_item(_id("fc"), call["id"], call["function"]["name"],
                                call["function"]["arguments"]))
    status, reason = _status(choice["finish_reason"])
    return JSONResponse(shape.done(shape.build(
        status, with_status(output, status),
        responses_usage(out, _token_count(tm.tokenizer, thought)), reason)))


def previous_conversation(store: ResponseStore, raw: Any) -> list[dict[str, Any]] | None:
    """The conversation a request's previous_response_id continues (None without one); a
    response this server does not keep (any more) is a 404."""
    previous = raw.get("previous_response_id") if isinstance(raw, dict) else None
    if previous is None:
        return None
    conversation = store.conversation(previous) if isinstance(previous, str) else None
    if conversation is None:
        raise APIError(f"no stored response {previous!r}: this server keeps the newest "
                       f"{store.capacity} responses stored (store true) in its memory",
                       status_code=404, param="previous_response_id")
    return conversation


class _Items:
    """The output items of a stream as they open and close, and their events."""

    def __init__(self, event: Any) -> None:
        self.event = event
        self.items: list[dict[str, Any]] = []  # final shapes, in output order
        self.open: str | None = None  # kind of the last item while it takes deltas
        self.texts: list[str] = []  # the text (or arguments) of each item so far
        self.calls: dict[int, int] = {}  # tool call index -> its item's position
        self.logprobs: list[dict[str, Any]] = []  # the open message's, with `include`

    def _add(self, item: dict[str, Any], kind: str) -> list[bytes]:
        events = self.close()
        self.items.append(item)
        self.texts.append("")
        self.open = kind
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=item))
        if kind in ("message", "reasoning"):
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     part=_part(kind, "")))
        return events

    def ensure_message(self) -> list[bytes]:
        """An answer with no output at all still has its (empty) message item."""
        if self.items:
            return []
        return self._add(message_item(_id("msg"), None, "in_progress"), "message")

    def text(self, kind: str, delta: str,
             logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        events: list[bytes] = []
        if self.open != kind:
            item = reasoning_item(_id("rs"), "", "in_progress") if kind == "reasoning" else \
                message_item(_id("msg"), None, "in_progress")
            events += self._add(item, kind)
        index = len(self.items) - 1
        self.texts[index] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        extra = {"logprobs": logprobs or []} if kind == "message" else {}
        if kind == "message":
            self.logprobs += logprobs or []
        events.append(self.event(name, item_id=self.items[index]["id"], output_index=index,
                                 content_index=0, delta=delta, **extra))
        return events

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        function = delta.get("function") or {}
        if "id" in delta:
            item = call_item(_id("fc"), delta["id"], function.get("name", ""), "", "in_progress")
            events += self._add(item, "function_call")
            self.open = None  # calls take their deltas until the end (finish_calls)
            self.calls[delta["index"]] = len(self.items) - 1
        fragment = function.get("arguments") or ""
        if fragment:
            index = self.calls[delta["index"]]
            self.texts[index] += fragment
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=self.items[index]["id"], output_index=index,
                                     delta=fragment))
        return events

    def close(self) -> list[bytes]:
        """Finish the open text item (its final shape in `items`, its done events)."""
        if self.open is None:
            return []
        index, kind, self.open = len(self.items) - 1, self.open, None
        item, text = self.items[index], self.texts[index]
        at = {"item_id": item["id"], "output_index": index}
        events = []
        if kind == "reasoning":
            item = reasoning_item(item["id"], text)
            events.append(self.event("response.reasoning_text.done", content_index=0,
                                     text=text, **at))
        else:
            item = message_item(item["id"], text, logprobs=self.logprobs)
            events.append(self.event("response.output_text.done", content_index=0, text=text,
                                     logprobs=self.logprobs, **at))
        part = item["content"][0] if kind == "message" else _part(kind, text)
        events.append(self.event("response.content_part.done", content_index=0, part=part,
                                 **at))
        self.logprobs = []
        self.items[index] = item
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def finish(self) -> list[bytes]:
        """The open item done, then every function call item (their arguments complete)."""
        events = self.close()
        for index in sorted(self.calls.values()):
            item = dict(self.items[index], arguments=self.texts[index], status="completed")
            self.items[index] = item
            events.append(self.event("response.function_call_arguments.done",
                                     item_id=item["id"], output_index=index,
                                     arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index,
                                     item=item))
        return events


async def stream_response(ctx: OpenAIContext, shape: ResponseShape, chat: ChatCompletionRequest,
                          plan: ToolPlan, split: ReasoningSplit | None,
                          reqs: list[GenerateRequest], request: Request
                          ) -> AsyncIterator[bytes]:
    """The events of a streamed response. The first ones wait for the first output, so a
    request refused before it (a full queue, a bad prompt) gets its own HTTP status; an error
    after them is an `error` event and `response.failed`."""
    tm = ctx.tokenizer_manager
    sequence = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\n" + sse(
            {"type": kind, "sequence_number": next(sequence), **fields})

    items = _Items(event)
    tool_stream = ToolCallStream(plan.parser, plan.max_calls) if plan.parse_output else None
    thought_stream = ReasoningStream(split) if split else None
    sent, thoughts, final, started, scored = 0, "", None, False, 0
    pending: list[dict[str, Any]] = []  # logprobs not yet sent with a text delta
    merged = tm.generate_merged(reqs, request)
    async with contextlib.aclosing(merged) as outputs:
        try:
            async for _, out in outputs:
                if not started:
                    started = True
                    yield event("response.created", response=shape.build("in_progress", [],
                                                                         None))
                    yield event("response.in_progress",
                                response=shape.build("in_progress", [], None))
                thought, answer = "", out.text
                if thought_stream is not None:
                    thought, answer = thought_stream.update(output_text(out, split),
                                                            out.finished)
                if tool_stream is None:
                    text, deltas = answer[sent:], []
                    sent = len(answer)
                else:
                    text, deltas = tool_stream.update(answer, out.finished)
                thoughts += thought
                if chat.logprobs:
                    tokens = out.meta_info.get("output_token_logprobs") or []
                    tops = out.meta_info.get("output_top_logprobs") or []
                    pending += logprob_content(tm.tokenizer, tokens[scored:], tops[scored:])
                    scored = len(tokens)
                events = items.text("reasoning", thought) if thought else []
                if text:
                    events += items.text("message", text, pending)
                    pending = []
                for delta in deltas:
                    events += items.call(delta)
                for data in events:
                    yield data
                if out.finished:
                    final = out
        except APIError as exc:
            if not started:
                raise
            yield event("error", code=exc.code, message=exc.message, param=exc.param)
            failed = shape.build("failed", items.items, None)
            failed["error"] = {"code": exc.code or "server_error", "message": exc.message}
            yield event("response.failed", response=failed)
            return
    for data in items.ensure_message() + items.finish():
        yield data
    assert final is not None
    called = tool_stream is not None and tool_stream.has_calls
    status, reason = _status(chat_finish_reason(final, called))
    usage = responses_usage(final, _token_count(tm.tokenizer, thoughts))
    yield event("response.completed" if status == "completed" else "response.incomplete",
                response=shape.done(shape.build(status, with_status(items.items, status), usage,
                                                reason)))
