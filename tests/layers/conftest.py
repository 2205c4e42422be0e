"""Fixtures shared by the kernel tests of this folder."""
from __future__ import annotations

import pytest


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """An empty folder of swept-configuration tables (kernels/gemm_tables.py) for one test."""
    from radixserve.layers.kernels import gemm_tables
    monkeypatch.setattr(gemm_tables, "CONFIG_DIR", tmp_path)
    gemm_tables.clear_cache()
    yield tmp_path
    gemm_tables.clear_cache()
