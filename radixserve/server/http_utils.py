"""Small HTTP helpers: JSON bodies and the API key check."""
from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from starlette.requests import Request

from radixserve.server.errors import APIError

PUBLIC_PATHS = frozenset({"/health"})


async def read_json(request: Request) -> Any:
    """The request's JSON body, parsed in a worker thread (a large body must not stall the
    event loop); malformed JSON is a 400, not a 500 or 422."""
    return await asyncio.to_thread(parse_json, await request.body())


def parse_json(raw: bytes) -> Any:
    """JSON that every later step can use: well-formed, not nested past Python's recursion
    limit, every string encodable as UTF-8 (no lone surrogates, which JSON's \\u escapes
    allow and tokenizers reject). A 400 otherwise."""
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    _check_strings(value)
    return value


def _check_strings(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError("the request holds text that is not valid Unicode (a lone "
                               "surrogate such as \\ud800)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def check_api_key(request: Request, api_key: str | None) -> APIError | None:
    """--api-key: every route but /health needs `Authorization: Bearer <key>`."""
    if api_key is None or request.url.path in PUBLIC_PATHS:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                          api_key.encode()):
        return None
    return APIError("Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                    status_code=401, code="invalid_api_key")
