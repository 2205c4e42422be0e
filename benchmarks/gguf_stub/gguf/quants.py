"""gguf.quants.dequantize, unavailable in the stub."""
from __future__ import annotations

from typing import Any


def dequantize(data: Any, qtype: Any) -> Any:
    raise RuntimeError("the gguf package is not installed (benchmarks/gguf_stub is in use)")
