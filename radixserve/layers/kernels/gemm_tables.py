"""Per-shape kernel configurations swept per board for decode-sized products.

`gemm_configs/{kind}_N{n}_K{k}.json` (kind: "bf16" or "fp8" weights) maps a row count M to the
entry that won at M: a GEMV configuration at M = 1 (block_n, block_k, num_warps, num_stages),
the skinny tile GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) above, or
{"kernel": "cublas"} where the vendor GEMM was faster. Each entry also records what was measured
("us", and "cublas_us" for bf16). benchmarks/gpu_gemm_tune.py writes these files. A batch of M
rows uses the entry of the smallest swept M' >= M (its tiles cover M rows); past the largest
swept M there is no entry and callers use their defaults.

The files in `gemm_configs/` were swept on the reference board (REFERENCE_BOARD, the H200) and
serve every board without tables of its own. Another board's sweeps go to
`gemm_configs/boards/{board}/` ({board}: the CUDA device name, spaces as underscores, e.g.
NVIDIA_H100_80GB_HBM3), a file there replacing the reference's file of the same name, so that a
sweep on one board never changes what another runs (as vLLM keys its fused-MoE tables by device
name). A board's file starts as a copy of the reference's (`writable_table`), so the entries its
sweep did not reach stay the reference's.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(os.environ.get("RADIXSERVE_GEMM_CONFIG_DIR",
                                 Path(__file__).parent / "gemm_configs"))
REFERENCE_BOARD = "NVIDIA_H200"  # the board whose sweeps are gemm_configs/'s own files


@functools.lru_cache(maxsize=None)
def board() -> str | None:
    """This process's board as the tables name it (the CUDA device name with runs of other
    characters than letters, digits, '.' and '-' as one '_'), or None without a CUDA device."""
    import torch
    if not torch.cuda.is_available():
        return None
    return re.sub(r"[^A-Za-z0-9.-]+", "_", torch.cuda.get_device_name()).strip("_")


def board_dir(name: str | None = None) -> Path:
    """Where the tables of board `name` (default: this process's) live: CONFIG_DIR itself for
    the reference board and without a device, else CONFIG_DIR/boards/{name}."""
    name = name or board()
    if name is None or name == REFERENCE_BOARD:
        return CONFIG_DIR
    return CONFIG_DIR / "boards" / name


def table_path(kind: str, n: int, k: int) -> Path:
    """The file this board reads for an [n, k] weight: its own where it has one, else the
    reference board's (which may not exist either)."""
    filename = f"{kind}_N{n}_K{k}.json"
    own = board_dir() / filename
    return own if own.is_file() else CONFIG_DIR / filename


def writable_table(kind: str, n: int, k: int) -> Path:
    """The file a sweep on this board writes for an [n, k] weight (benchmarks/gpu_*.py
    --write). A board other than the reference starts its file as a copy of the reference's,
    so that the row counts and variants the sweep leaves alone keep their entries."""
    filename = f"{kind}_N{n}_K{k}.json"
    path = board_dir() / filename
    reference = CONFIG_DIR / filename
    if not path.is_file() and path != reference:
        path.parent.mkdir(parents=True, exist_ok=True)
        if reference.is_file():
            shutil.copyfile(reference, path)
    return path


def shipped_boards() -> list[str]:
    """The reference board and every board with tables of its own."""
    others = (CONFIG_DIR / "boards").glob("*")
    return [REFERENCE_BOARD] + sorted(path.name for path in others if path.is_dir())


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
