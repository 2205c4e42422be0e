"""Shared fixtures for the server tests."""
from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm_tokenizer() -> Any:
    """The bundled SmolLM2-135M-Instruct tokenizer, through the loader."""
    from radixserve.loader.tokenizer import get_tokenizer

    return get_tokenizer("SmolLM2-135M-Instruct")
