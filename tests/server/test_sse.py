"""Server-Sent Event framing (openai_common.sse), shared by /generate and the OpenAI routes."""
from __future__ import annotations

import json

from radixserve.server.openai_common import sse


def test_events_are_utf8_json_lines() -> None:
    event = sse({"text": "Zoë 東京", "ids": (1, 2), 3: "non-string key"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    payload = event[len(b"data: "):-2]
    assert "Zoë 東京".encode() in payload  # not \\u-escaped
    assert json.loads(payload) == {"text": "Zoë 東京", "ids": [1, 2], "3": "non-string key"}


def test_non_finite_floats_become_null_and_strings_pass_as_they_are() -> None:
    assert json.loads(sse({"logprob": float("-inf")})[6:]) == {"logprob": None}
    assert sse("[DONE]") == b"data: [DONE]\n\n"
