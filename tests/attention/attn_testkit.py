"""Random KV pools and batches for the attention kernel tests (shared by the files here)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {torch.float32: dict(atol=1e-4, rtol=1e-4),
            torch.float16: dict(atol=3e-3, rtol=3e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}[dtype]


@dataclass
class RandomPool:
    req_to_token: torch.Tensor  # [num_rows, max_context_len] int32
    k_buffer: torch.Tensor  # [num_slots + 1, Hkv, D]
    v_buffer: torch.Tensor
    req_pool_indices: torch.Tensor  # [bs] int64, distinct rows in shuffled order
    seq_lens: torch.Tensor  # [bs] int64


def random_pool(seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device = DEVICE, seed: int = 0) -> RandomPool:
    """KV slots of every request are a random permutation of the pool (slot 0 never used),
    request rows are scattered over a req_to_token table with spare rows."""
    gen = torch.Generator().manual_seed(seed)
    bs, max_len = len(seq_lens), max(seq_lens) + 3
    total = sum(seq_lens)
    num_slots = total + 7
    slots = torch.randperm(num_slots, generator=gen)[:total] + 1
    num_rows = bs + 3
    rows = torch.randperm(num_rows, generator=gen)[:bs]
    req_to_token = torch.zeros((num_rows, max_len), dtype=torch.int32)
    offset = 0
    for row, seq_len in zip(rows.tolist(), seq_lens):
        req_to_token[row, :seq_len] = slots[offset:offset + seq_len].int()
        offset += seq_len
    shape = (num_slots + 1, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=gen).to(dtype)
    v_buffer = torch.randn(shape, generator=gen).to(dtype)
    return RandomPool(req_to_token.to(device), k_buffer.to(device), v_buffer.to(device),
                      rows.to(device), torch.tensor(seq_lens, device=device))


def make_context(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, num_layers: int = 1, num_rows: int = 8,
                 max_context_len: int = 96, num_slots: int = 400, max_bs: int | None = None):
    """An AttentionContext over fresh pools (what a ModelRunner gives its backend)."""
    from radixserve.attention.base import AttentionContext
    from radixserve.mem.kv_pool import KVCacheSpec, make_kv_pool
    from radixserve.mem.req_to_token_pool import ReqToTokenPool
    spec = KVCacheSpec("mha", num_layers, num_kv_heads, head_dim, dtype)
    return AttentionContext(num_heads, num_kv_heads, head_dim, torch.device(device),
                            max_bs if max_bs is not None else num_rows,
                            ReqToTokenPool(num_rows, max_context_len, device),
                            make_kv_pool(num_slots, spec, device))


class PoolDriver:
    """Plays the scheduler's part for one backend: real pools, request rows, KV slots, and the
    ForwardBatch of each pass (the caller builds the backend's metadata). `make_backend` builds
    the backend from the context over the driver's pools."""

    def __init__(self, make_backend: Any, dtype: torch.dtype, device: torch.device,
                 num_kv_heads: int, head_dim: int, num_layers: int, num_rows: int = 8,
                 max_context_len: int = 96, num_slots: int = 400, num_heads: int = 4,
                 max_bs: int | None = None) -> None:
        self.dtype, self.device = dtype, device
        context = make_context(num_heads, num_kv_heads, head_dim, device, dtype, num_layers,
                               num_rows, max_context_len, num_slots, max_bs)
        self.req_pool, self.kv_pool = context.req_to_token_pool, context.kv_pool
        self.backend = make_backend(context)
        self.seq_len: dict[int, int] = {}  # request row -> tokens in the pool

    def new_request(self, shared_prefix_from: int | None = None, prefix_len: int = 0) -> int:
        row = self.req_pool.alloc(1)[0]
        if shared_prefix_from is not None:  # a radix-cache hit: reuse another row's KV slots
            table = self.req_pool.req_to_token
            table[row, :prefix_len] = table[shared_prefix_from, :prefix_len]
        self.seq_len[row] = prefix_len
        return row

    def batch(self, mode: object, rows: list[int], extend_lens: list[int]) -> object:
        from radixserve.core.forward_batch import ForwardBatch, ModelWorkerBatch
        prefix_lens = [self.seq_len[r] for r in rows]
        out_cache_loc = self.kv_pool.alloc(sum(extend_lens))
        offset = 0
        for row, prefix_len, ext_len in zip(rows, prefix_lens, extend_lens):
            locs = out_cache_loc[offset:offset + ext_len]
            self.req_pool.req_to_token[row, prefix_len:prefix_len + ext_len] = locs.to(
                self.device, torch.int32)
            self.seq_len[row] = prefix_len + ext_len
            offset += ext_len
        seq_lens = [self.seq_len[r] for r in rows]
        worker = ModelWorkerBatch(mode, input_ids=[0] * sum(extend_lens), req_pool_indices=rows,
                                  seq_lens=seq_lens, out_cache_loc=out_cache_loc)
        if mode.is_extend():
            worker.extend_seq_lens, worker.extend_prefix_lens = extend_lens, prefix_lens
        return ForwardBatch.from_worker_batch(worker, self.device, self.backend)
