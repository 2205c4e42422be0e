"""HF checkpoints: config.json and the tensors of every *.safetensors file in a folder."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def read_hf_config(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def safetensors_files(folder: str) -> list[str]:
    return sorted(str(p) for p in Path(folder).glob("*.safetensors"))


def iter_safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every *.safetensors file in `folder`, in the
    dtype stored (usually bf16), names as saved (transformers state-dict names); nothing is
    skipped or renamed. Tensors are memory-mapped views: copy them into parameters promptly."""
    files = safetensors_files(folder)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
