"""ReqToTokenPool: the request-to-slot table, (request row, position) -> KV slot.

The table has one row past `size`, `padding_row`, never handed out: padded (CUDA graph) requests
point at it, so the decode pass's table write for them touches no real request.

It keeps a host copy of its table (`host_table`, written at the same points as the device table)
so the scheduler reads a request's slots (`read_row`, when it finishes or its prompt is cached)
without a device sync: with overlapped decode a step is still running then, and reading the
device table would wait for it.

This class is the table's one writer; nothing else indexes into it for writing. Its callers:
the scheduler's BatchBuilder (every slot it allocates: `write`, and `write_host_positions` for
the slots of a decode step), the radix cache (`write`, pointing a row's duplicate positions at
the tree's slots when a prompt is cached) and the decode pass (`write_decode_slots`, the device
half of a decode step's slots, inside the CUDA graph on replay).
"""
from __future__ import annotations

import mmap

import numpy as np
import torch


def _lazy_zeros(rows: int, cols: int) -> np.ndarray:
    """An int32 [rows, cols] table of zeros whose pages are mapped only when first written, in
    small pages: only the positions written take host memory (the table is 2 GB at 4,096 rows
    of a 128K context, a request writes a few KB of its row). numpy's own zeros ask for huge
    pages on an array this large, and the first write to each then zeroes 2 MB: ~670 us on
    this CPU against ~1 us for a 4 KB page."""
    try:
        buffer = mmap.mmap(-1, max(rows * cols * 4, 1),
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, TypeError, OSError):  # no anonymous private mappings here
        return np.zeros((rows, cols), dtype=np.int32)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buffer, dtype=np.int32, count=rows * cols).reshape(rows, cols)


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str | torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.padding_row = size
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32,
                                        device=self.device)
        self.host_table = _lazy_zeros(size + 1, max_context_len)
        # a stack, most recently freed row on top: rows are reused while their host pages are
        # mapped. Handed out first-in-first-out, every request would take a row never touched
        # since start-up, and its first write a page fault (with numpy's huge pages, zeroing
        # 2 MB: 670 us per row at a 128K context on this CPU against 7.6 us reused; ~1.2 s of
        # the H200's 4,000 x 128/8 run, docs/PERFORMANCE.md, session 12)
        self.free_slots: list[int] = list(range(size - 1, -1, -1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        if need_size == 0:
            return []
        taken = self.free_slots[-need_size:][::-1]
        del self.free_slots[-need_size:]
        return taken

    def free(self, slot: int | list[int]) -> None:
        if isinstance(slot, int):
            self.free_slots.append(slot)
        else:
            self.free_slots.extend(slot)

    def clear(self) -> None:
        self.free_slots = list(range(self.size - 1, -1, -1))

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Table and host copy: row[start:start + len(slots)] = slots (CPU int tensor).
        Never waits for the device (a pass may be running: the copy is queued behind it)."""
        if len(slots) == 0:
            return
        slots = slots.to("cpu", torch.int32)
        self.host_table[row, start:start + len(slots)] = slots.numpy()
        self.req_to_token[row, start:start + len(slots)] = slots.to(self.device,
                                                                    non_blocking=True)

    def write_many(self, writes: list[tuple[int, int, torch.Tensor]]) -> None:
        """`write(row, start, slots)` for each, with one copy to the device for all of them
        (a prefill batch's rows)."""
        writes = [(row, start, slots) for row, start, slots in writes if len(slots)]
        if not writes:
            return
        if len(writes) == 1:
            self.write(*writes[0])
            return
        rows, positions, values = [], [], []
        for row, start, slots in writes:
            host = slots.to("cpu", torch.int32).numpy()
            self.host_table[row, start:start + len(host)] = host
            rows.append(np.full(len(host), row, dtype=np.int64))
            positions.append(np.arange(start, start + len(host), dtype=np.int64))
            values.append(host.astype(np.int64))
        packed = torch.from_numpy(np.stack((np.concatenate(rows), np.concatenate(positions),
                                            np.concatenate(values))))
        packed = packed.to(self.device, non_blocking=True)
        self.req_to_token[packed[0], packed[1]] = packed[2].to(torch.int32)

    def write_host_positions(self, rows: list[int], positions: list[int],
                             slots: torch.Tensor) -> None:
        """Host copy only: row[position] = slot for each (the device side of a decode step's
        slots is written by the pass itself, write_decode_slots)."""
        self.host_table[rows, positions] = slots.numpy()

    def write_positions(self, rows: list[int], positions: list[int],
                        slots: torch.Tensor) -> None:
        """Table and host copy: row[position] = slot for each (one new token per request, in a
        pass that does not write them itself: the decode part of a MIXED pass)."""
        self.write_host_positions(rows, positions, slots)
        index = torch.tensor([rows, positions], dtype=torch.int64).to(self.device,
                                                                     non_blocking=True)
        self.req_to_token[index[0], index[1]] = slots.to(self.device, torch.int32,
                                                         non_blocking=True)

    def read_row(self, row: int, length: int) -> torch.Tensor:
        """The first `length` slots of a row, int64 on the CPU, from the host copy (no sync)."""
        return torch.from_numpy(self.host_table[row, :length].astype(np.int64))

    def write_decode_slots(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                           out_cache_loc: torch.Tensor) -> None:
        """Record each request's new KV slot at position seq_len - 1 (device tensors, no sync).
        The ModelRunner calls this for every DECODE pass (inside the CUDA graph on replay); the
        host copy got the same slots from BatchBuilder.prepare_decode."""
        self.req_to_token[req_pool_indices, seq_lens - 1] = out_cache_loc.to(torch.int32)
