"""Per-shape kernel configurations swept on the H200 for decode-sized products.

`gemm_configs/{kind}_N{n}_K{k}.json` (kind: "bf16" or "fp8" weights) maps a row count M to the
entry that won at M: a GEMV configuration at M = 1 (block_n, block_k, num_warps, num_stages),
the skinny tile GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) above, or
{"kernel": "cublas"} where the vendor GEMM was faster. Each entry also records what was measured
("us", and "cublas_us" for bf16). benchmarks/gpu_gemm_tune.py writes these files. A batch of M
rows uses the entry of the smallest swept M' >= M (its tiles cover M rows); past the largest
swept M there is no entry and callers use their defaults.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(os.environ.get("RADIXSERVE_GEMM_CONFIG_DIR",
                                 Path(__file__).parent / "gemm_configs"))


@functools.lru_cache(maxsize=None)
def _table(kind: str, n: int, k: int) -> tuple[tuple[int, dict[str, Any]], ...]:
    path = CONFIG_DIR / f"{kind}_N{n}_K{k}.json"
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
