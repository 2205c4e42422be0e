"""Arrival counters for kernels whose programs finish a shared output tile together.

A kernel that splits one output tile over several programs (split K, split KV) can let the last
program to finish add the partial results and write the tile, instead of launching a second
kernel: each program stores its partial, then increments the tile's counter (an atomic with
release/acquire semantics); the one that sees count == programs - 1 reads every partial, writes
the tile, and sets the counter back to zero for the next launch.
"""
from __future__ import annotations

import torch

COUNTER_SLOTS = 1 << 14  # output tiles one launch may have (64 KB of counters per stream)
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 zeros, one per output tile, shared by the launches on this device and stream
    (every launch leaves them at zero again). Launches on one stream run one after another (PDL
    included: a kernel's programs wait for the previous grid before any load), so they can
    share one array; it is kept for the life of the process (CUDA graphs hold its address), and
    another stream gets its own."""
    assert tiles <= COUNTER_SLOTS
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[key]
