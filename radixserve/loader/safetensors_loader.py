"""HF checkpoints: config.json and the tensors of a folder's weight files.

The weight files are those the folder's `*.safetensors.index.json` names (its weight_map), as
transformers and vLLM read them: shards left over from another save, or Mistral's
`consolidated.safetensors` beside the HF shards, are not read. Without an index, every
`*.safetensors` file, less `consolidated*.safetensors` where others exist.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixserve.loader.checkpoint_error import CheckpointError

logger = logging.getLogger(__name__)


def read_hf_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def safetensors_files(folder: str) -> list[str]:
    """The folder's weight files (module docstring); CheckpointError when its index names
    files that are not there."""
    root = Path(folder)
    found = sorted(root.glob("*.safetensors"))
    listed = _index_shards(root)
    if listed is not None:
        missing = sorted(name for name in listed if not (root / name).is_file())
        if missing:
            raise CheckpointError(f"{folder}: the weight index names {len(missing)} file(s) "
                                  f"that are not there: {', '.join(missing[:3])}")
        return sorted(str(root / name) for name in listed)
    plain = [p for p in found if not p.name.startswith("consolidated")]
    return [str(p) for p in (plain or found)]


def index_shards(index: Path) -> set[str] | None:
    """The shard files one `*.safetensors.index.json` names (its weight_map's values; none
    where it has no weight_map), or None where it cannot be read as such an index."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(weight_map, dict):
        return None
    return {str(name) for name in weight_map.values()}


def _index_shards(root: Path) -> set[str] | None:
    """The shard files the folder's weight indexes name; None without a readable index."""
    shards: set[str] = set()
    indexes = sorted(root.glob("*.safetensors.index.json"))
    for index in indexes:
        named = index_shards(index)
        if not named:
            logger.warning("%s has no readable weight_map; reading every *.safetensors file",
                           index)
            return None
        shards |= named
    return shards if indexes else None


def iter_safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the folder's weight files, in the dtype stored
    (usually bf16), names as saved (transformers state-dict names); nothing is skipped or
    renamed. Tensors are memory-mapped views: copy them into parameters promptly."""
    files = safetensors_files(folder)
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
