"""Names radixserve's loader imports from gguf.constants; the stub knows no quant sizes."""
from __future__ import annotations

from enum import IntEnum


class GGMLQuantizationType(IntEnum):
    F32 = 0
    F16 = 1
    BF16 = 30


class _NoQuantSizes(dict):
    def __missing__(self, key: object) -> tuple[int, int]:
        raise RuntimeError("the gguf package is not installed (benchmarks/gguf_stub is in use)")


GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = _NoQuantSizes()
