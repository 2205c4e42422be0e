"""One coroutine per HTTP API: send one request, time its token events, return a RequestOutput.

  radixserve   POST /generate, SSE lines "data: {json}" with cumulative "text" and "meta_info"
               ({"prompt_tokens", "completion_tokens", "cached_tokens", ...}), then "data: [DONE]"
               (or, from a server with --incremental-streaming-output, the new text and ids).
  openai       POST /v1/completions (prompt = token ids or text), usage in the last chunk.
  openai-chat  POST /v1/chat/completions (one user message of text), usage in the last chunk.
Every request asks for greedy decoding with ignore_eos so the output length is exactly the
length asked for; the server's reported usage is what gets counted. A stream that ends before
its last event (a finish reason on /generate, "data: [DONE]" on the OpenAI APIs) is a failed
request. --extra-request-body is merged into each body key by key, nested objects included.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp

from radixserve.bench.metrics import RequestOutput


@dataclass
class RequestInput:
    api_url: str
    prompt_len: int
    output_len: int
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    model: str | None = None
    stream: bool = True
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    lora_name: str | None = None  # an adapter: radixserve's lora_path, OpenAI's model


class TokenClock:
    """Turns token events into TTFT and inter-token gaps."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: float | None = None
        self.ttft = 0.0
        self.itl: list[float] = []

    def token_event(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class StreamEndedEarly(Exception):
    """A stream whose body ended before the server said it was complete."""


async def sse_events(response: aiohttp.ClientResponse,
                     require_done: bool = False) -> AsyncIterator[dict[str, Any]]:
    """Decoded JSON payloads of "data:" lines, until "data: [DONE]" or the end of the body
    (StreamEndedEarly at the end of the body when `require_done`)."""
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, "event:" lines
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)
    if require_done:
        raise StreamEndedEarly("the stream ended early, without data: [DONE]")


def merge_body(body: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`body` with `extra` merged in, nested dicts key by key; `extra`'s values win."""
    merged = dict(body)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_body(merged[key], value)
        else:
            merged[key] = value
    return merged


async def _post(session: aiohttp.ClientSession, req: RequestInput, body: dict[str, Any],
                handle: Callable[[aiohttp.ClientResponse, RequestOutput, TokenClock],
                                 Awaitable[None]]) -> RequestOutput:
    out = RequestOutput(prompt_len=req.prompt_len, expected_output_len=req.output_len,
                        streamed=req.stream)
    clock = TokenClock()
    try:
        async with session.post(req.api_url, json=merge_body(body, req.extra_body),
                                headers=req.headers) as response:
            if response.status != 200:
                text = await response.text()
                out.error = f"HTTP {response.status}: {text[:300]}"
                return out
            await handle(response, out, clock)
        out.latency = clock.elapsed()
        out.ttft, out.itl = (clock.ttft, clock.itl) if req.stream else (out.latency, [])
        out.success = not out.error
        if req.stream and clock.last is None and out.success:
            out.success, out.error = False, "stream carried no token"
    except Exception as exc:  # network errors, bad JSON: the request failed, the run goes on
        out.error = f"{type(exc).__name__}: {exc}"
        out.success = False
    return out


def _read_meta(out: RequestOutput, meta: dict[str, Any]) -> None:
    if "prompt_tokens" in meta:
        out.prompt_len = int(meta["prompt_tokens"])
    if "completion_tokens" in meta:
        out.output_len = int(meta["completion_tokens"])
    if meta.get("cached_tokens") is not None:
        out.cached_tokens = int(meta["cached_tokens"])


def _read_usage(out: RequestOutput, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    out.prompt_len = int(usage.get("prompt_tokens", out.prompt_len))
    out.output_len = int(usage.get("completion_tokens", out.output_len))
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        out.cached_tokens = int(details["cached_tokens"])


async def request_radixserve(session: aiohttp.ClientSession, req: RequestInput) -> RequestOutput:
    body: dict[str, Any] = {
        "sampling_params": {"max_new_tokens": req.output_len, "ignore_eos": True,
                            "temperature": 0.0},
        "stream": req.stream,
    }
    if req.prompt_ids is not None:
        body["input_ids"] = req.prompt_ids
    else:
        body["text"] = req.prompt_text
    if req.lora_name is not None:
        body["lora_path"] = req.lora_name

    async def handle(response: aiohttp.ClientResponse, out: RequestOutput,
                     clock: TokenClock) -> None:
        if not req.stream:
            data = await response.json()
            data = data[0] if isinstance(data, list) else data
            out.generated_text = data.get("text", "")
            _read_meta(out, data.get("meta_info", {}))
            return
        tokens_seen = 0
        finished = False
        async for event in sse_events(response):
            if "error" in event:
                out.error = str(event["error"])
                return
            meta = event.get("meta_info", {})
            finished = finished or meta.get("finish_reason") is not None
            text = event.get("text", "")
            # a token event is a chunk with more tokens (or, without counts, more text)
            count = int(meta.get("completion_tokens", tokens_seen + (text != out.generated_text)))
            if count > tokens_seen:
                clock.token_event()
                tokens_seen = count
            # --incremental-streaming-output: a chunk holds fewer ids than the count so far
            ids = event.get("output_ids")
            incremental = ids is not None and len(ids) < count
            out.generated_text = out.generated_text + text if incremental else text
            _read_meta(out, meta)
        if not finished:
            out.error = "the stream ended early, without a finish reason"

    return await _post(session, req, body, handle)


def _openai_body(req: RequestInput) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": req.output_len, "temperature": 0.0,
                            "ignore_eos": True, "stream": req.stream}
    if req.lora_name or req.model:
        body["model"] = req.lora_name or req.model
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _handle_openai(response: aiohttp.ClientResponse, out: RequestOutput, clock: TokenClock,
                         stream: bool, chat: bool) -> None:
    if not stream:
        data = await response.json()
        choice = (data.get("choices") or [{}])[0]
        if chat:
            out.generated_text = (choice.get("message") or {}).get("content") or ""
        else:
            out.generated_text = choice.get("text", "")
        _read_usage(out, data.get("usage"))
        return
    pieces: list[str] = []
    async for event in sse_events(response, require_done=True):
        if "error" in event:
            out.error = str(event["error"])
            return
        _read_usage(out, event.get("usage"))
        for choice in event.get("choices") or []:
            if chat:
                delta = choice.get("delta") or {}
                piece = delta.get("content")
                if piece is None or (piece == "" and "role" in delta):
                    continue  # the opening role-only chunk, or a finish-only chunk
            else:
                piece = choice.get("text")
                if piece is None:
                    continue
            if piece == "" and choice.get("finish_reason"):
                continue
            clock.token_event()
            pieces.append(piece)
    out.generated_text = "".join(pieces)


async def request_openai_completions(session: aiohttp.ClientSession,
                                     req: RequestInput) -> RequestOutput:
    body = _openai_body(req)
    body["prompt"] = req.prompt_ids if req.prompt_ids is not None else req.prompt_text

    async def handle(response: aiohttp.ClientResponse, out: RequestOutput,
                     clock: TokenClock) -> None:
        await _handle_openai(response, out, clock, req.stream, chat=False)

    return await _post(session, req, body, handle)


async def request_openai_chat(session: aiohttp.ClientSession, req: RequestInput) -> RequestOutput:
    if req.prompt_text is None:
        raise ValueError("openai-chat needs text prompts: pass --tokenizer to decode token ids")
    body = _openai_body(req)
    body["messages"] = [{"role": "user", "content": req.prompt_text}]

    async def handle(response: aiohttp.ClientResponse, out: RequestOutput,
                     clock: TokenClock) -> None:
        await _handle_openai(response, out, clock, req.stream, chat=True)

    return await _post(session, req, body, handle)


RequestFunc = Callable[[aiohttp.ClientSession, RequestInput], Awaitable[RequestOutput]]

# backend name -> (path appended to the base URL, request coroutine)
BACKENDS: dict[str, tuple[str, RequestFunc]] = {
    "radixserve": ("/generate", request_radixserve),
    "openai": ("/v1/completions", request_openai_completions),
    "openai-chat": ("/v1/chat/completions", request_openai_chat),
}
