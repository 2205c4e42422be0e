"""Token-granular KV memory.

ReqToTokenPool maps (request slot, position) -> KV slot. TokenToKVPool holds the per-layer K and
V tensors indexed by KV slot. Page size is 1. KV slot 0 is never handed out: it is the padding
sink that padded (CUDA graph) requests write to, so valid slots are 1..size. Likewise the request
table has one row past `size`, `padding_row`, never handed out: padded requests point at it, so
the decode pass's table write for them touches no real request.

ReqToTokenPool keeps a host copy of its table (`host_table`, written at the same points as the
device table) so the scheduler reads a request's slots (`read_row`, when it finishes or its
prompt is cached) without a device sync: with overlapped decode a step is still running then,
and reading the device table would wait for it.

Ownership: whoever allocates frees. The scheduler allocates request slots and KV slots; the radix
cache takes ownership of KV slots it inserts and frees them on eviction.
"""
from __future__ import annotations

import numpy as np
import torch


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str | torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.padding_row = size
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32,
                                        device=self.device)
        # numpy's zeros are calloc'd: only rows and columns written take host memory
        self.host_table = np.zeros((size + 1, max_context_len), dtype=np.int32)
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        taken = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return taken

    def free(self, slot: int | list[int]) -> None:
        if isinstance(slot, int):
            self.free_slots.append(slot)
        else:
            self.free_slots.extend(slot)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Table and host copy: row[start:start + len(slots)] = slots (CPU int tensor)."""
        slots = slots.to("cpu", torch.int32)
        self.host_table[row, start:start + len(slots)] = slots.numpy()
        self.req_to_token[row, start:start + len(slots)] = slots.to(self.device)

    def write_host_positions(self, rows: list[int], positions: list[int],
                             slots: torch.Tensor) -> None:
        """Host copy only: row[position] = slot for each (the device side of a decode step's
        slots is written by the pass itself, write_decode_slots)."""
        self.host_table[rows, positions] = slots.numpy()

    def read_row(self, row: int, length: int) -> torch.Tensor:
        """The first `length` slots of a row, int64 on the CPU, from the host copy (no sync)."""
        return torch.from_numpy(self.host_table[row, :length].astype(np.int64))

    def write_decode_slots(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                           out_cache_loc: torch.Tensor) -> None:
        """Record each request's new KV slot at position seq_len - 1 (device tensors, no sync).
        The ModelRunner calls this for every DECODE pass (inside the CUDA graph on replay); the
        host copy got the same slots from BatchBuilder.prepare_decode."""
        self.req_to_token[req_pool_indices, seq_lens - 1] = out_cache_loc.to(torch.int32)


class TokenToKVPool:
    def __init__(self, size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str | torch.device) -> None:
        self.size = size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        shape = (size + 1, head_num, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device)
                         for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device)
                         for _ in range(layer_num)]
        # kept on the CPU: allocation is a scheduler decision and must not sync the device
        self.free_slots = torch.arange(1, size + 1, dtype=torch.int64)

    @staticmethod
    def bytes_per_token(dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int) -> int:
        return 2 * layer_num * head_num * head_dim * torch.tensor([], dtype=dtype).element_size()

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Return `need_size` free KV slots (int64, CPU), or None if there are not enough."""
        if need_size > self.free_slots.numel():
            return None
        taken = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return taken

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        self.free_slots = torch.cat((self.free_slots, slots.to(torch.int64).cpu()))

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """Write k/v ([num_tokens, head_num, head_dim]) into slots `loc` of one layer."""
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)
