"""Which files of an HF folder hold its weights, and in which format.

A folder's weights are safetensors where it has any (`*.safetensors` files or their index),
else PyTorch pickles (`pytorch_model*.bin`, as transformers saves them); never both, as vLLM
chooses. The weight files are those the format's index (`*.safetensors.index.json`,
`pytorch_model.bin.index.json`) names in its weight_map, as transformers and vLLM read them:
shards left over from another save, or Mistral's `consolidated.safetensors` beside the HF
shards, are not read. Without an index, every file of the format, less `consolidated*` where
others exist. Imports nothing heavy: model resolution uses it before torch is loaded.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from radixserve.loader.checkpoint_error import CheckpointError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightFormat:
    """A kind of weight file. `name` is what ModelSource.format says; the globs serve
    Path.glob and the hub's allow_patterns alike."""

    name: str
    file_glob: str
    index_glob: str


SAFETENSORS = WeightFormat("safetensors", "*.safetensors", "*.safetensors.index.json")
PYTORCH_BIN = WeightFormat("pt", "pytorch_model*.bin", "pytorch_model*.bin.index.json")
FORMATS = (SAFETENSORS, PYTORCH_BIN)  # the preferred first


def weight_format(folder: str) -> WeightFormat | None:
    """The format of the folder's weights: the first of FORMATS with a file or an index there;
    None where it has neither."""
    root = Path(folder)
    return next((fmt for fmt in FORMATS
                 if any(root.glob(fmt.file_glob)) or any(root.glob(fmt.index_glob))), None)


def weight_files(folder: str, fmt: WeightFormat | None = None) -> list[str]:
    """The folder's weight files of `fmt` (default: the folder's own format; [] without
    weights), as the module docstring says; CheckpointError when its index names files that
    are not there."""
    fmt = fmt or weight_format(folder)
    if fmt is None:
        return []
    root = Path(folder)
    listed = _index_shards(root, fmt)
    if listed is not None:
        missing = _absent(root, listed)
        if missing:
            raise CheckpointError(f"{folder}: the weight index names {len(missing)} file(s) "
                                  f"that are not there: {', '.join(missing[:3])}")
        return sorted(str(root / name) for name in listed)
    found = sorted(root.glob(fmt.file_glob))
    plain = [p for p in found if not p.name.startswith("consolidated")]
    return [str(p) for p in (plain or found)]


def missing_weight_files(folder: str) -> list[str]:
    """Weight files a hub snapshot folder lacks, for its completeness check: the shards the
    indexes of its format name that are not there (an unreadable index: the index), or the
    format's glob when it holds no such file at all (safetensors' for a folder without
    weights; broken links count as missing). Empty when the weights are complete."""
    root = Path(folder)
    fmt = weight_format(folder) or SAFETENSORS
    missing: list[str] = []
    for index in sorted(root.glob(fmt.index_glob)):
        shards = index_shards(index)
        if shards is None:
            return [index.name]
        missing += _absent(root, shards)
    if not any(p.is_file() for p in root.glob(fmt.file_glob)):
        missing = missing or [fmt.file_glob]
    return missing


def index_shards(index: Path) -> set[str] | None:
    """The shard files one weight index names (its weight_map's values; none where it has no
    weight_map), or None where it cannot be read as such an index."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(weight_map, dict):
        return None
    return {str(name) for name in weight_map.values()}


def _index_shards(root: Path, fmt: WeightFormat) -> set[str] | None:
    """The shard files the folder's indexes of `fmt` name; None without a readable index."""
    shards: set[str] = set()
    indexes = sorted(root.glob(fmt.index_glob))
    for index in indexes:
        named = index_shards(index)
        if not named:
            logger.warning("%s has no readable weight_map; reading every %s file",
                           index, fmt.file_glob)
            return None
        shards |= named
    return shards if indexes else None


def _absent(root: Path, names: set[str]) -> list[str]:
    """The sorted names of `names` that are not files in `root` (a broken link is absent)."""
    return sorted(name for name in names if not (root / name).is_file())
