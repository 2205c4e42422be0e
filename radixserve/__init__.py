"""radixserve: a fast LLM serving runtime (RadixAttention prefix cache, v0.2-style scheduler)."""
from __future__ import annotations

from typing import Any

from radixserve.core.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Engine":  # lazy: importing the package must not load torch models
        from radixserve.engine import Engine
        return Engine
    raise AttributeError(name)
