"""The FastAPI application: routes, API key check, and errors in OpenAI's JSON shape.

Every error leaves as {"error": {"message", "type", "param", "code"}} with the status codes
listed in errors.py; FastAPI's default 422 for validation problems is turned into 400 (as OpenAI
and vLLM answer).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.server.asgi_guards import BodyLimitMiddleware, CatchAllMiddleware
from radixserve.core.sampling_params import InvalidRequestError
from radixserve.server.errors import APIError, ClientDisconnected, status_phrase
from radixserve.server.http_metrics import HTTPMetricsMiddleware
from radixserve.server.http_utils import check_api_key
from radixserve.server.lora_control import lora_router
from radixserve.server.native_api import is_warm_up, native_router
from radixserve.server.openai_api import openai_router
from radixserve.server.openai_common import OpenAIContext
from radixserve.server.reasoning import reasoning_format
from radixserve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


class APIKeyMiddleware:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which gets in the way of streaming and
    of disconnect detection)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.api_key is not None:
            error = check_api_key(Request(scope), self.api_key)
            if error is not None:
                await error.to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(tm: TokenizerManager, api_key: str | None, model_name: str,
              model_aliases: frozenset[str], server_info: Callable[[], dict[str, Any]],
              is_ready: Callable[[], bool], max_request_bytes: int = 64 << 20,
              tool_call_parser: str | None = None,
              incremental_streaming_output: bool = False,
              reasoning_parser: str | None = None,
              exclude_tools_when_tool_choice_none: bool = False,
              is_embedding: bool = False) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        try:
            yield
        finally:
            await tm.stop()

    app = FastAPI(title="radixserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    ctx = OpenAIContext(tokenizer_manager=tm, model_name=model_name, model_aliases=model_aliases,
                        tool_call_parser=tool_call_parser,
                        exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
                        reasoning=reasoning_format(reasoning_parser, tm.tokenizer),
                        is_embedding=is_embedding)
    routers = [native_router(tm, server_info, is_ready, incremental_streaming_output,
                             is_embedding),
               openai_router(ctx, tm.limits.context_len), lora_router(tm)]
    for router in routers:
        app.include_router(router)
    app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    app.add_middleware(CatchAllMiddleware)  # whatever escapes the rest
    # outermost of ours: counts every answer, the middlewares' own included
    app.add_middleware(HTTPMetricsMiddleware, metrics=tm.metrics,
                       routes=[route for router in routers for route in router.routes],
                       is_internal=lambda scope: is_warm_up(scope, is_ready))

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> Response:
        return exc.to_response()

    @app.exception_handler(InvalidRequestError)
    async def on_invalid_request(_: Request, exc: InvalidRequestError) -> Response:
        return APIError(str(exc), param=exc.param).to_response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return APIError(f"invalid request: {exc.errors()[:1]}").to_response()

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else status_phrase(exc.status_code)
        return APIError(message, status_code=exc.status_code).to_response()

    return app
