"""Where requests are built (parsed, templated, tokenised, grammar-checked): threads off the
event loop, so it keeps serving other requests and /health meanwhile, in three lanes, so a
huge prompt or a slow grammar delays only its own kind. Bodies of BULK_BODY_BYTES and more go
to the bulk lane (one thread), those that may carry a grammar (`asks_for_grammar`) to the
grammar one (two threads: a grammar whose check runs to its limit holds up one), the rest to
the main lane (one thread).

The lanes share the tokenizer: encode and decode only read it (the Rust side is borrowed
shared); the one write, dropping a truncation or padding setting that tokenizer.json shipped,
is done once, before any lane runs."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from starlette.requests import Request

from radixserve.core.sampling_params import GRAMMAR_KINDS
from radixserve.server.errors import APIError

T = TypeVar("T")

# request bodies from this size on are built in the bulk lane: tokenising 256 KB of text takes
# ~0.15 s on one core (10 MB: ~5 s), which must not delay the small requests queued behind it
BULK_BODY_BYTES = 256 * 1024
# a request body with any of these (top level, or in /generate's sampling_params) is built in
# the grammar lane: checking a grammar can take up to its time limit
# (scheduler/grammar/validation.py), which requests without one must not wait for
_GRAMMAR_FIELDS = frozenset(GRAMMAR_KINDS) | {"response_format", "guided_json", "guided_regex",
                                              "guided_choice", "guided_grammar", "tool_choice"}


def asks_for_grammar(raw: Any) -> bool:
    """Whether a request body (parsed JSON) may carry a grammar to check."""
    if not isinstance(raw, dict):
        return False
    params = raw.get("sampling_params")
    nested = params if isinstance(params, list) else [params]
    return not _GRAMMAR_FIELDS.isdisjoint(raw) or any(
        isinstance(p, dict) and not _GRAMMAR_FIELDS.isdisjoint(p) for p in nested)


class RequestLanes:
    def __init__(self, tokenizer: Any | None) -> None:
        if tokenizer is not None:
            tokenizer.encode("warm-up")  # its one write, before the lanes share it
        self.main = ThreadPoolExecutor(max_workers=1, thread_name_prefix="request-build")
        self.bulk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="request-build-bulk")
        self.grammar = ThreadPoolExecutor(max_workers=2,
                                          thread_name_prefix="request-build-grammar")

    def shutdown(self) -> None:
        for lane in (self.main, self.bulk, self.grammar):
            lane.shutdown(wait=False, cancel_futures=True)

    async def lane_for(self, request: Request, raw: Any) -> ThreadPoolExecutor:
        """The lane of a request whose parsed body is `raw` (Starlette keeps the body
        read_json read, so its size costs nothing)."""
        if asks_for_grammar(raw):
            return self.grammar
        if len(await request.body()) >= BULK_BODY_BYTES:
            return self.bulk
        return self.main

    async def offload(self, fn: Callable[..., T], *args: Any,
                      lane: ThreadPoolExecutor | None = None) -> T:
        """Run `fn(*args)` in a thread of `lane` (`lane_for`; the main lane by default). Its
        exceptions (APIError for bad input) reach the caller as they are."""
        def call() -> tuple[Any, APIError | None]:
            try:
                return fn(*args), None
            except APIError as exc:
                # a fresh error, without the traceback whose frames hold the request's big
                # locals (a 20 MB text, millions of token ids): they are freed here, in this
                # thread, not on the event loop when the error is handled
                return None, APIError(exc.message, exc.status_code, exc.param, exc.code,
                                      exc.error_type)

        result, error = await asyncio.get_running_loop().run_in_executor(
            lane or self.main, call)
        if error is not None:
            raise error
        return result
