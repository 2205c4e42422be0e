"""API errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Status codes used by every route (native and OpenAI):
  400 invalid_request_error  malformed JSON, wrong types, out-of-range values, empty prompt,
                             prompt (+ max tokens) over the context length, unsupported fields
  401 invalid_request_error  missing or wrong API key (code "invalid_api_key")
  404 invalid_request_error  unknown model name (code "model_not_found") or route
  405 invalid_request_error  a route called with the wrong method
  413 invalid_request_error  a body over --max-request-bytes (answered before it is read)
  429 rate_limit_error       the scheduler's waiting queue is full (--max-queued-requests)
  499 (no body)              the client went away; nothing is sent back
  500 server_error           an internal error (logged once with its traceback)
  503 server_error           not ready yet, shutting down, or a server process died
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES.get(status_code, "server_error")

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_json(), status_code=self.status_code)


class ClientDisconnected(Exception):
    """The HTTP client went away; its request was aborted in the scheduler."""


def status_phrase(status_code: int) -> str:
    try:
        return HTTPStatus(status_code).phrase
    except ValueError:
        return "Error"
