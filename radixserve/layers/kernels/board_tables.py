"""Swept kernel tables per board: which file of a tables folder a board reads and writes.

A tables folder (kernels/gemm_configs/, kernels/moe_configs/) holds the reference board's
sweeps (REFERENCE_BOARD, the H200) as its own files; they serve every board without tables of
its own. Another board's sweeps live in `{folder}/boards/{board}/` ({board}: the CUDA device
name, runs of other characters than letters, digits, '.' and '-' as one '_', e.g.
NVIDIA_H100_80GB_HBM3), a file there replacing the reference's file of the same name, so that a
sweep on one board never changes what another runs (vLLM keys its fused-MoE tables by device
name the same way). A board's file starts as a copy of the reference's (`write_path`), so the
entries its sweep did not reach stay the reference's.
"""
from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path

REFERENCE_BOARD = "NVIDIA_H200"  # the board whose sweeps are a tables folder's own files


@functools.lru_cache(maxsize=None)
def current_board() -> str | None:
    """This process's board as the tables name it, or None without a CUDA device."""
    import torch
    if not torch.cuda.is_available():
        return None
    return re.sub(r"[^A-Za-z0-9.-]+", "_", torch.cuda.get_device_name()).strip("_")


def board_dir(root: Path, board: str | None) -> Path:
    """Where `board`'s tables live in the folder `root`: root itself for the reference board
    and without a device, else root/boards/{board}."""
    if board is None or board == REFERENCE_BOARD:
        return root
    return root / "boards" / board


def read_path(root: Path, filename: str, board: str | None) -> Path:
    """The file `board` reads: its own where it has one, else the reference board's (which
    may not exist either)."""
    own = board_dir(root, board) / filename
    return own if own.is_file() else root / filename


def write_path(root: Path, filename: str, board: str | None) -> Path:
    """The file a sweep on `board` writes. A board other than the reference starts its file
    as a copy of the reference's, so that what the sweep leaves alone keeps its entries."""
    path = board_dir(root, board) / filename
    reference = root / filename
    if not path.is_file() and path != reference:
        path.parent.mkdir(parents=True, exist_ok=True)
        if reference.is_file():
            shutil.copyfile(reference, path)
    return path


def boards_in(root: Path) -> list[str]:
    """The reference board and every board with tables of its own in `root`."""
    others = (root / "boards").glob("*")
    return [REFERENCE_BOARD] + sorted(path.name for path in others if path.is_dir())
