"""Progress bars for the slow parts of start-up (weights, CUDA graphs): tqdm on a terminal;
off a terminal (logs, CI) the items pass through unchanged and the log lines tell the story."""
from __future__ import annotations

import sys
from typing import Iterable, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, unit: str,
             total: int | None = None) -> Iterable[T]:
    if not sys.stderr.isatty():
        return items
    from tqdm import tqdm
    return tqdm(items, desc=desc, unit=unit, total=total, leave=False)
