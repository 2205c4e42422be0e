"""A real server with --speculative-algorithm ngram on the bundled SmolLM2, through the openai
client: a chat answer that copies its prompt streams the same text as the plain server's
non-streamed answer, drafts are accepted (/get_server_info, /metrics), and the KV accounting
is clean once idle."""
from __future__ import annotations

from typing import Any, Iterator

import openai
import pytest
import requests

from tests.server.conftest import API_KEY
from tests.server.server_process import ServerProcess

# 26 s (a server); n-gram drafts through the Engine: tests/scheduler/test_spec_decode.py, in CI
pytestmark = pytest.mark.slow

TEXT = ("The river town woke slowly in the autumn mornings. Fishermen pushed their boats from "
        "the muddy bank while the baker on the corner lit his ovens, and the smell of bread "
        "drifted down to the water.")
MESSAGES = [{"role": "user",
             "content": f"Repeat the following text exactly, word for word:\n\n{TEXT}"}]


@pytest.fixture(scope="module")
def spec_server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--speculative-algorithm", "ngram",
                         "--speculative-ngram-min-match-window-size", "1", api_key=API_KEY)
    yield proc
    assert proc.stop() == 0, proc.log_text()[-3000:]


def test_spec_server_streams_plain_decodings_text(spec_server: ServerProcess,
                                                  openai_client: Any, model_name: str) -> None:
    plain = openai_client.chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=0, max_tokens=80)
    client = openai.OpenAI(base_url=spec_server.url("/v1"), api_key=API_KEY, max_retries=0,
                           timeout=300)
    chunks = client.chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=0, max_tokens=80, stream=True,
        stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == plain.choices[0].message.content
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
    info = spec_server.wait_idle_memory_check()
    state = info["internal_state"]
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    assert state["spec_accept_length"] > 1.5, state  # the answer copies the prompt
    metrics = requests.get(spec_server.url("/metrics"), headers=spec_server.headers,
                           timeout=30).text
    line = next(x for x in metrics.splitlines() if x.startswith("radixserve:spec_accept_length"))
    assert float(line.rsplit(" ", 1)[1]) > 1.5
