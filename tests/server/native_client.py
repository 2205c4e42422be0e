"""Small client helpers for the native API (/generate) in the server tests."""
from __future__ import annotations

import json
from typing import Any

import requests

PROMPT = "Once upon a time"


def post(server: Any, path: str, body: Any, **kwargs: Any) -> requests.Response:
    return requests.post(server.url(path), json=body, headers=server.headers, timeout=300,
                         **kwargs)


def greedy(max_new_tokens: int) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0}


def sse_events(response: requests.Response) -> list[Any]:
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
