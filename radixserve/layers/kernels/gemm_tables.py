"""Per-shape kernel configurations swept per board for decode-sized products.

`gemm_configs/{kind}_N{n}_K{k}.json` (kind: "bf16" or "fp8" weights) maps a row count M to the
entry that won at M: a GEMV configuration at M = 1 (block_n, block_k, num_warps, num_stages),
the skinny tile GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) above, or
{"kernel": "cublas"} where the vendor GEMM was faster. Each entry also records what was measured
("us", and "cublas_us" for bf16). benchmarks/gpu_gemm_tune.py writes these files. A batch of M
rows uses the entry of the smallest swept M' >= M (its tiles cover M rows); past the largest
swept M there is no entry and callers use their defaults.

Per board (kernels/board_tables.py): `gemm_configs/`'s own files are the H200's and serve every
board without tables of its own; another board reads and writes `gemm_configs/boards/{board}/`.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from radixserve.layers.kernels import board_tables

CONFIG_DIR = Path(os.environ.get("RADIXSERVE_GEMM_CONFIG_DIR",
                                 Path(__file__).parent / "gemm_configs"))
REFERENCE_BOARD = board_tables.REFERENCE_BOARD


def board() -> str | None:
    """This process's board (board_tables.current_board; tests replace it)."""
    return board_tables.current_board()


def board_dir(name: str | None = None) -> Path:
    """Where the tables of board `name` (default: this process's) live."""
    return board_tables.board_dir(CONFIG_DIR, name or board())


def table_path(kind: str, n: int, k: int) -> Path:
    """The file this board reads for an [n, k] weight."""
    return board_tables.read_path(CONFIG_DIR, f"{kind}_N{n}_K{k}.json", board())


def writable_table(kind: str, n: int, k: int) -> Path:
    """The file a sweep on this board writes for an [n, k] weight (benchmarks/gpu_*.py
    --write), seeded from the reference's."""
    return board_tables.write_path(CONFIG_DIR, f"{kind}_N{n}_K{k}.json", board())


def shipped_boards() -> list[str]:
    """The reference board and every board with tables of its own."""
    return board_tables.boards_in(CONFIG_DIR)


@functools.lru_cache(maxsize=None)
def _table(kind: str, n: int, k: int) -> tuple[tuple[int, dict[str, Any]], ...]:
    path = table_path(kind, n, k)
    if not path.is_file():
        return ()
    raw = json.loads(path.read_text())
    return tuple(sorted((int(m), entry) for m, entry in raw.items()))


@functools.lru_cache(maxsize=None)
def tuned_entry(kind: str, n: int, k: int, m: int) -> dict[str, Any] | None:
    """The swept entry covering M rows of an [n, k] weight, or None. Cached: eager FP8 linears
    ask on every call (callers only read the entry)."""
    for swept_m, entry in _table(kind, n, k):
        if swept_m >= m:
            return entry if (swept_m == 1) == (m == 1) else None
    return None


def clear_cache() -> None:
    _table.cache_clear()
    tuned_entry.cache_clear()
