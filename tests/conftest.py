"""Suite-wide options and fixtures: the `slow` marker's cases run only when asked for, and
`table_dir` gives a kernel test its own empty folder of swept-configuration tables.

CI runs the README's test command on a 2-core machine and must stay under 15 minutes, so the
long end-to-end cases (each starts its own server or runs a model for tens of seconds, and each
covers a path that a faster case also reaches) are marked `slow` and skipped by default. Run
them with `bash scripts/test.sh --run-slow` (or RADIXSERVE_RUN_SLOW=1); `-m slow` selects them
alone. `slow_interpreted` marks the Triton cases that are slow only under the CPU interpreter
(larger shapes, whole Engine runs): skipped like `slow` where there is no GPU, run on one.
"""
from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run under the CPU interpreter when there is no GPU. TRITON_INTERPRET is read
# when a kernel is decorated, so it is set here, before any test module (or anything a test
# module imports, e.g. transformers' DeepSeek-V3 code through the `kernels` package) imports
# triton or the kernel modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the cases marked slow (skipped by default)")


def _slow_wanted(config: pytest.Config) -> bool:
    if config.getoption("--run-slow") or os.environ.get("RADIXSERVE_RUN_SLOW") == "1":
        return True
    markexpr = config.getoption("-m") or ""
    return "slow" in markexpr and "not slow" not in markexpr


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _slow_wanted(config):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    interpreted = not torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords or (interpreted and "slow_interpreted" in item.keywords):
            item.add_marker(skip)


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """An empty folder of swept-configuration tables (kernels/gemm_tables.py) for one test,
    read and written as the reference board's on any machine (`as_board` changes that)."""
    from radixserve.layers.kernels import gemm_tables
    monkeypatch.setattr(gemm_tables, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(gemm_tables, "board", lambda: None)
    gemm_tables.clear_cache()
    yield tmp_path
    gemm_tables.clear_cache()


@pytest.fixture
def as_board(monkeypatch):
    """Call with a board's name to have the tables read as on that board (gemm_tables.board)."""
    from radixserve.layers.kernels import gemm_tables

    def use(name: str | None) -> None:
        monkeypatch.setattr(gemm_tables, "board", lambda: name)
        gemm_tables.clear_cache()
    yield use
    gemm_tables.clear_cache()
