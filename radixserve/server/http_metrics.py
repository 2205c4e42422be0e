"""Counting HTTP responses by method, route and status (radixserve:http_responses_total), as
vLLM's instrumented FastAPI app does: operators read error rates (4xx from bad input, 401 from
a wrong key, 413, 503 while shutting down, 500 from a bug) from /metrics.

A plain ASGI middleware, outermost, so it sees the answers the other middlewares give (401,
413, the catch-all's 500) as well as the routes'. The route label is the route's template
(`/v1/models/{model_id:path}`), or "unmatched" for paths no route serves, so the label's
values stay few whatever paths clients send. A request answered with no status line (the
client left first) is not counted, nor is the server's own warm-up (`is_internal`).
"""
from __future__ import annotations

from typing import Callable

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.metrics import ServerMetrics

UNMATCHED_ROUTE = "unmatched"


class HTTPMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: list[BaseRoute],
                 is_internal: Callable[[Scope], bool] = lambda scope: False) -> None:
        """`routes`: the routers' own routes (APIRouter.routes), matched here by path and
        method, also for answers given before routing (401, 413). `is_internal`: requests the
        server sends itself, left out."""
        self.app = app
        self.metrics = metrics
        self.routes = routes
        self.is_internal = is_internal
        self._route_of_path: dict[tuple[str, str], str] = {}  # (method, path) -> template

    def route_label(self, scope: Scope) -> str:
        key = (scope.get("method", ""), scope.get("path", ""))
        label = self._route_of_path.get(key)
        if label is None:
            label = UNMATCHED_ROUTE
            for route in self.routes:
                match, _ = route.matches(scope)
                if match != Match.NONE:  # PARTIAL: the path matches, the method does not
                    label = getattr(route, "path", UNMATCHED_ROUTE)
                    if match == Match.FULL:
                        break
            if label != UNMATCHED_ROUTE and len(self._route_of_path) < 4096:
                self._route_of_path[key] = label
        return label

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.is_internal(scope):
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_responses.labels(
                    method=scope.get("method", ""), route=self.route_label(scope),
                    status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
