"""HF checkpoints: config.json and the tensors of a folder's safetensors weight files (which
files: weight_files.py)."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from radixserve.loader.checkpoint_error import CheckpointError
from radixserve.loader.weight_files import SAFETENSORS, weight_files


def read_hf_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def iter_safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the folder's safetensors files, in the dtype
    stored (usually bf16), names as saved (transformers state-dict names); nothing is skipped or
    renamed. Tensors are memory-mapped views: copy them into parameters promptly."""
    files = weight_files(folder, SAFETENSORS)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for path in files:
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError and OSErrors
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
        with handle as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
