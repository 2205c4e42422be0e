"""A small aiohttp server that speaks the streaming protocols the benchmark client uses.

It produces exactly max_new_tokens tokens when ignore_eos is set (else stops after
`eos_after` tokens, like a model hitting EOS), reports usage honestly, keeps a prefix "cache"
(cached_tokens = the longest common prefix with any earlier prompt) and refuses prompts longer
than `max_prompt_len` (or of a length in `refuse_prompt_lens`) with HTTP 400. Every request body
it receives is recorded. With `api_key` set, every endpoint answers HTTP 401 to a request without
"Authorization: Bearer KEY".
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeServerState:
    max_prompt_len: int = 10_000
    refuse_prompt_lens: set[int] = field(default_factory=set)
    # /generate streams one token, then an error event, for prompts of these lengths
    midstream_error_prompt_lens: set[int] = field(default_factory=set)
    # streams end cleanly before their last event (/generate: the one with the finish reason;
    # OpenAI: the usage) and without [DONE], for prompts of these lengths
    cut_stream_prompt_lens: set[int] = field(default_factory=set)
    api_key: str | None = None
    flushes: int = 0
    eos_after: int = 2
    vocab_size: int | None = None  # served by /get_model_info when set
    token_delay_s: float = 0.001
    bodies: list[dict[str, Any]] = field(default_factory=list)
    refused_prompts: list[list[Any]] = field(default_factory=list)
    seen_prompts: list[list[Any]] = field(default_factory=list)
    cached_total: int = 0
    prompt_total: int = 0


def _common_prefix_len(a: list[Any], b: list[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class FakeServer:
    def __init__(self, state: FakeServerState | None = None) -> None:
        self.state = state or FakeServerState()
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "FakeServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._check_api_key])
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_post("/flush_cache", self.flush_cache)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    @web.middleware
    async def _check_api_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key = self.state.api_key
        if key is not None and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "bad api key"}, status=401)
        return await handler(request)

    # -- shared logic --------------------------------------------------------------------------
    def _admit(self, body: dict[str, Any], prompt: list[Any]) -> tuple[int, int] | None:
        """(number of tokens to produce, cached prompt tokens), or None to refuse."""
        s = self.state
        s.bodies.append(body)
        if len(prompt) > s.max_prompt_len or len(prompt) in s.refuse_prompt_lens:
            s.refused_prompts.append(prompt)
            return None
        cached = max((_common_prefix_len(prompt, p) for p in s.seen_prompts), default=0)
        s.seen_prompts.append(prompt)
        s.cached_total += cached
        s.prompt_total += len(prompt)
        params = body.get("sampling_params", body)
        wanted = params.get("max_new_tokens", params.get("max_tokens", 16))
        n = wanted if params.get("ignore_eos") else min(wanted, s.eos_after)
        return n, cached

    @staticmethod
    def _prompt_of(body: dict[str, Any]) -> list[Any]:
        prompt = body.get("input_ids", body.get("prompt", body.get("text")))
        if prompt is None:
            prompt = " ".join(m["content"] for m in body["messages"])
        return prompt.split() if isinstance(prompt, str) else list(prompt)

    async def _sse(self, request: web.Request, events: list[dict[str, Any]],
                   prompt: list[Any]) -> web.StreamResponse:
        cut = len(prompt) in self.state.cut_stream_prompt_lens
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events[:-1] if cut else events:
            await asyncio.sleep(self.state.token_delay_s)
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        if not cut:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # -- endpoints -----------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = self._prompt_of(body)
        admitted = self._admit(body, prompt)
        if admitted is None:
            return web.json_response({"error": "prompt too long"}, status=400)
        n, cached = admitted

        def meta(i: int) -> dict[str, Any]:
            return {"prompt_tokens": len(prompt), "completion_tokens": i, "cached_tokens": cached,
                    "finish_reason": {"type": "length"} if i == n else None}

        texts = [" ".join(f"t{j}" for j in range(i)) for i in range(1, n + 1)]
        if not body.get("stream"):
            return web.json_response({"text": texts[-1] if texts else "", "meta_info": meta(n)})
        events = [{"text": t, "meta_info": meta(i + 1)} for i, t in enumerate(texts)]
        if len(prompt) in self.state.midstream_error_prompt_lens:
            events = events[:1] + [{"error": {"message": "scheduler died", "code": 500}}]
        return await self._sse(request, events, prompt)

    def _usage(self, prompt: list[Any], n: int, cached: int) -> dict[str, Any]:
        return {"prompt_tokens": len(prompt), "completion_tokens": n,
                "total_tokens": len(prompt) + n, "prompt_tokens_details": {"cached_tokens": cached}}

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        prompt = self._prompt_of(body)
        admitted = self._admit(body, prompt)
        if admitted is None:
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        n, cached = admitted
        usage = self._usage(prompt, n, cached)
        if not body.get("stream"):
            text = "".join(f"t{j} " for j in range(n))
            choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            return web.json_response({"choices": [{**choice, "index": 0,
                                                   "finish_reason": "length"}], "usage": usage})

        def choice(piece: str, finish: str | None) -> dict[str, Any]:
            content = {"delta": {"content": piece}} if chat else {"text": piece}
            return {"index": 0, "finish_reason": finish, **content}

        events: list[dict[str, Any]] = []
        if chat:
            events.append({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}]})
        events += [{"choices": [choice(f"t{j} ", "length" if j == n - 1 else None)]}
                   for j in range(n)]
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        if include_usage:
            events.append({"choices": [], "usage": usage})
        return await self._sse(request, events, prompt)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def model_info(self, request: web.Request) -> web.Response:
        if self.state.vocab_size is None:
            raise web.HTTPNotFound()
        return web.json_response({"vocab_size": self.state.vocab_size})

    async def metrics(self, request: web.Request) -> web.Response:
        s = self.state
        rate = s.cached_total / s.prompt_total if s.prompt_total else 0.0
        text = ("# HELP fake_cache_hit_rate prefix cache hit rate\n"
                f"# TYPE fake_cache_hit_rate gauge\nfake_cache_hit_rate {rate}\n")
        return web.Response(text=text)

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.state.flushes += 1
        self.state.seen_prompts.clear()
        return web.Response(text="ok")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
