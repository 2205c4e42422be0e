"""Shared fixtures for the server tests."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.server.server_process import ServerProcess, wait_gone

API_KEY = "test-secret-key"


@pytest.fixture(scope="session")
def smollm_tokenizer() -> Any:
    """The bundled SmolLM2-135M-Instruct tokenizer, through the loader."""
    from radixserve.loader.tokenizer import get_tokenizer

    return get_tokenizer("SmolLM2-135M-Instruct")


def tokenizer_with_special_tokens(tokens: tuple[str, ...]) -> Any:
    """A fresh SmolLM2 tokenizer with `tokens` added as special tokens (a tool format's
    markers, as the model's own vocabulary has them)."""
    from radixserve.loader.tokenizer import get_tokenizer

    tokenizer = get_tokenizer("SmolLM2-135M-Instruct")
    tokenizer.add_tokens(list(tokens), special_tokens=True)
    return tokenizer


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One real server (bundled model, CPU, --api-key) shared by the e2e test files. Its
    --reasoning-parser qwen3 changes only outputs that open with <think> (which the bundled
    model writes only when a grammar makes it)."""
    proc = ServerProcess("--reasoning-parser", "qwen3", api_key=API_KEY)
    yield proc
    info = proc.server_info() if proc.proc.poll() is None else {}
    code = proc.stop()
    assert code == 0, f"server exited with {code} on SIGTERM:\n{proc.log_text()[-3000:]}"
    for key in ("scheduler_pid", "detokenizer_pid"):
        if key in info:
            assert wait_gone(info[key]), f"{key} outlived the server"


@pytest.fixture(scope="session")
def openai_client(server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0,
                         timeout=300)


@pytest.fixture(scope="session")
def model_name(openai_client: Any) -> str:
    return openai_client.models.list().data[0].id
