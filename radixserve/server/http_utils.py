"""Small HTTP helpers: JSON bodies and the API key check."""
from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.requests import Request

from radixserve.server.errors import APIError

PUBLIC_PATHS = frozenset({"/health"})


async def read_json(request: Request) -> Any:
    """The request's JSON body; malformed JSON is a 400, not a 500 or 422."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None


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
