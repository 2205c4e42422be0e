"""benchmarks/gpu_gemm_tune.py's table writing (the sweep itself needs a GPU): a rewritten row
count keeps what the other sweeps stored in its entry."""
from __future__ import annotations

from benchmarks.gpu_gemm_tune import OTHER_SWEEPS_KEYS, merged


def test_a_rewritten_entry_keeps_the_other_sweeps_configurations() -> None:
    rows_gemv = {"block_n": 4, "block_k": 1024, "num_warps": 4, "num_stages": 3, "us": 15.2}
    old = {"1": {"block_n": 16, "norm": {"block_n": 16}},
           "2": {"kernel": "cublas", "us": 15.3, "plain": rows_gemv, "norm": {"block_n": 2}},
           "8": {"kernel": "cublas", "us": 15.6}}
    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "us": 15.2}
    new = {"2": {"kernel": "cublas", "us": 15.1, "triton_us": 15.9, "triton": tile},
           "8": tile}
    table = merged(old, new)
    assert table["1"] == old["1"]  # not swept this time
    assert table["2"]["plain"] == rows_gemv and table["2"]["norm"] == {"block_n": 2}
    assert table["2"]["us"] == 15.1 and table["2"]["triton"] == tile
    assert table["8"] == tile  # the old vendor entry is gone
    assert "plain" in OTHER_SWEEPS_KEYS
