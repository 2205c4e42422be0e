"""The user cache folder, and atomic writes into it.

Root: $RADIXSERVE_CACHE_DIR, else $XDG_CACHE_HOME/radixserve, else ~/.cache/radixserve.
Entries derived from a file are keyed by its absolute path, size and mtime (plus a format version
and the library versions that shape the output), so a changed or replaced file gets a new entry.
An entry exists only once complete: it is written under a temporary name and renamed into place,
so concurrent processes (TP ranks, parallel tests) never read half-written files.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Bump when what we derive from a GGUF (config dict, tokenizer files) changes.
CACHE_FORMAT_VERSION = "2"  # 2: MoE GGUF files (Mixtral was derived as Llama)


def radixserve_cache_dir() -> Path:
    explicit = os.environ.get("RADIXSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "radixserve"


def file_cache_folder(kind: str, source_path: str, extra_key: str = "") -> Path:
    """The cache folder for things derived from `source_path` (not created here)."""
    real = os.path.realpath(source_path)
    stat = os.stat(real)
    key_text = "|".join([real, str(stat.st_size), str(stat.st_mtime_ns),
                         CACHE_FORMAT_VERSION, extra_key])
    digest = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    stem = Path(real).stem
    return radixserve_cache_dir() / kind / f"{stem}-{digest}"


def read_cached_json(path: Path) -> Any | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json_atomically(path: Path, value: Any) -> bool:
    """Write `value` as JSON to `path` via a temporary file; False (and a log line) on failure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        logger.warning("could not write cache file %s: %s", path, exc)
        return False


def write_folder_atomically(path: Path, fill: Callable[[Path], None]) -> bool:
    """Create folder `path` by calling `fill(tmp_folder)` and renaming it into place.

    If another process created `path` first, ours is discarded and theirs kept. Returns whether
    `path` exists afterwards.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    except OSError as exc:
        logger.warning("could not create cache folder under %s: %s", path.parent, exc)
        return False
    try:
        fill(tmp)
        os.rename(tmp, path)
    except OSError as exc:
        if not path.is_dir():
            logger.warning("could not write cache folder %s: %s", path, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path.is_dir()
