"""Model loading: resolve --model-path, read config and weights (GGUF, safetensors, dummy), and
build tokenizers. Entry points: `load_model_source`, `get_tokenizer`, `init_dummy_weights`.

Exports are lazy so that importing one loader module does not import transformers.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_model_source": "radixserve.loader.model_source",
    "ModelSource": "radixserve.loader.model_source",
    "resolve_model_path": "radixserve.loader.model_resolution",
    "ResolvedModel": "radixserve.loader.model_resolution",
    "get_tokenizer": "radixserve.loader.tokenizer",
    "init_dummy_weights": "radixserve.loader.dummy_loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'radixserve.loader' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
