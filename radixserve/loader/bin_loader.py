"""The tensors of an HF folder's `pytorch_model*.bin` weight files (which files:
weight_files.py), for checkpoints that ship no safetensors.

Each file is read with torch's safe unpickler (`weights_only=True`: tensors, dicts and plain
values only, never code from the file) and memory-mapped, so a large shard is not held in RAM
beside the parameters it fills. Files in torch's legacy (pre-zip) format cannot be mapped and
are read whole. A file that cannot be read so, or holds anything but a state dict of tensors,
is a one-line CheckpointError naming it.
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from radixserve.loader.checkpoint_error import CheckpointError
from radixserve.loader.weight_files import PYTORCH_BIN, weight_files

_ZIP_MAGIC = b"PK\x03\x04"  # what torch.save has written since torch 1.6; mmap needs it
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def iter_bin_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the folder's .bin weight files, as
    iter_safetensors_weights does for safetensors: stored dtype, names as saved, nothing skipped
    or renamed; tensors are memory-mapped views, to be copied into parameters promptly."""
    files = weight_files(folder, PYTORCH_BIN)
    if not files:
        raise FileNotFoundError(f"no {PYTORCH_BIN.file_glob} files in {folder}")
    for path in files:
        yield from read_state_dict(path).items()


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """One .bin file's state dict (module docstring)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip(path))
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError, ...
        raise CheckpointError(f"{path} is not readable as PyTorch weights (torch.load with "
                              f"weights_only=True, which runs no code): {_reason(exc)}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
    for name, tensor in state.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{path}: {name!r} is a {type(tensor).__name__}, not a tensor")
    return state


def _is_zip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC


def _reason(exc: Exception) -> str:
    """The gist of torch.load's error in one line: the unpickler's own complaint where there
    is one (not torch's advice about weights_only around it), else the first sentence."""
    text = _ANSI_ESCAPE.sub("", str(exc)).split("WeightsUnpickler error:", 1)[-1]
    lines = (line.strip() for line in text.splitlines())
    gist = next((line for line in lines if line and "weights_only" not in line
                 and not line.startswith("Check the documentation")), "")
    gist = gist.split(". ", 1)[0].rstrip(".")
    return f"{type(exc).__name__}: {gist}" if gist else type(exc).__name__
