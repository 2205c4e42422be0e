"""The body limit answers 413 before reading an oversized body (by Content-Length, or as a
chunked body passes the limit); an unexpected error is logged once and answered 500."""
from __future__ import annotations

import asyncio
import logging

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.requests import ClientDisconnect, Request

from radixserve.server.asgi_guards import BodyLimitMiddleware, CatchAllMiddleware


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"size": len(await request.body())}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("bug")

    app.add_middleware(BodyLimitMiddleware, max_bytes=1000)
    app.add_middleware(CatchAllMiddleware)
    return app


def test_body_limit() -> None:
    client = TestClient(_app())
    assert client.post("/echo", content=b"x" * 1000).json() == {"size": 1000}
    too_big = client.post("/echo", content=b"x" * 1001)
    assert too_big.status_code == 413 and "max-request-bytes" in too_big.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(5):
            yield b"y" * 300

    assert client.post("/echo", content=chunks()).status_code == 413


def test_unexpected_error_is_one_log_line_and_a_500(caplog: pytest.LogCaptureFixture) -> None:
    client = TestClient(_app(), raise_server_exceptions=False)
    with caplog.at_level(logging.ERROR):
        response = client.get("/boom")
    assert response.status_code == 500
    assert response.json()["error"]["message"].startswith("internal error")
    records = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(records) == 1 and records[0].exc_info is not None


def test_a_client_gone_mid_body_is_no_error(caplog: pytest.LogCaptureFixture) -> None:
    async def reads_a_body(scope, receive, send) -> None:
        raise ClientDisconnect()  # what Request.body() raises when the client left

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    with caplog.at_level(logging.INFO):
        asyncio.run(CatchAllMiddleware(reads_a_body)(
            {"type": "http", "method": "POST", "path": "/v1/completions"}, receive, send))
    assert sent == []  # no 500 to a client that is gone
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("disconnected" in r.getMessage() for r in caplog.records)
