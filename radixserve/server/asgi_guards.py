"""Two plain ASGI middlewares that keep bad input and bugs away from the event loop's health.

BodyLimitMiddleware (--max-request-bytes): a request whose Content-Length is over the limit is
answered 413 before its body is read; a chunked body is cut off with a 413 as soon as it passes
the limit. CatchAllMiddleware: an exception no handler turned into a response becomes one log
line with its traceback and a 500 that says an internal error happened (Starlette's own
fallback logs it twice and re-raises); a stream that already started is just ended. A client
that disconnects while sending its body is one info line, not an error.
"""
from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.errors import APIError

logger = logging.getLogger(__name__)


class _BodyTooLarge(Exception):
    pass


class _StartTracker:
    """Wraps `send` and remembers whether the response has started (status line out)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self._send(message)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(f"the request body is larger than --max-request-bytes "
                        f"({self.max_bytes} bytes)", status_code=413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large().to_response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        tracker = _StartTracker(send)
        try:
            await self.app(scope, limited_receive, tracker)
        except _BodyTooLarge:
            if not tracker.started:
                await self._too_large().to_response()(scope, receive, send)


class CatchAllMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tracker = _StartTracker(send)
        try:
            await self.app(scope, receive, tracker)
        except ClientDisconnect:  # the client left while sending its body: no one to answer
            logger.info("client disconnected while sending %s %s", scope.get("method"),
                        scope.get("path"))
        except Exception:  # noqa: BLE001 - the last line of defence: log once, answer 500
            logger.exception("internal error serving %s %s", scope.get("method"),
                             scope.get("path"))
            if not tracker.started:
                error = APIError("internal error while serving the request (the server log "
                                 "has the details)", status_code=500)
                await error.to_response()(scope, receive, send)
