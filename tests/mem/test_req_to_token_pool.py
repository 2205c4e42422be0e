"""ReqToTokenPool's writes: the device table and its host copy agree, one write or many."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from radixserve.mem.req_to_token_pool import ReqToTokenPool

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_write_many_equals_writes_one_by_one(device: str) -> None:
    rng = random.Random(3)
    one, many = ReqToTokenPool(8, 64, device), ReqToTokenPool(8, 64, device)
    for _ in range(5):
        writes = []
        for row in rng.sample(range(8), 5):
            start = rng.randrange(0, 40)
            length = rng.choice([0, 1, rng.randrange(2, 24)])
            dtype = rng.choice([torch.int64, torch.int32])
            writes.append((row, start, torch.tensor(
                [rng.randrange(1, 10_000) for _ in range(length)], dtype=dtype)))
        for row, start, slots in writes:
            one.write(row, start, slots)
        many.write_many(writes)
        assert np.array_equal(one.host_table, many.host_table)
        assert torch.equal(one.req_to_token.cpu(), many.req_to_token.cpu())
        assert np.array_equal(many.host_table, many.req_to_token.cpu().numpy())


def test_an_empty_write_touches_nothing() -> None:
    pool = ReqToTokenPool(2, 8, "cpu")
    pool.write(1, 7, torch.empty(0, dtype=torch.int64))
    pool.write_many([(0, 3, torch.empty(0, dtype=torch.int64))])
    assert not pool.host_table.any() and not pool.req_to_token.any()


def test_rows_are_reused_most_recently_freed_first() -> None:
    """Rows come back as a stack: a new request takes a row whose host pages are mapped
    already, not one untouched since start-up (whose first write faults its pages in)."""
    pool = ReqToTokenPool(size=8, max_context_len=16, device="cpu")
    assert pool.alloc(3) == [0, 1, 2]
    pool.free(1)
    assert pool.alloc(1) == [1]
    pool.free([0, 2])
    assert pool.alloc(2) == [2, 0]
    assert pool.alloc(0) == [] and pool.available_size() == 5
    assert pool.alloc(6) is None
    assert sorted(pool.alloc(5)) == [3, 4, 5, 6, 7] and pool.available_size() == 0
    pool.clear()
    assert pool.alloc(2) == [0, 1]


def test_the_host_table_starts_zero_and_takes_writes_anywhere() -> None:
    """The host copy is a lazily mapped table of zeros: any row and column reads 0 until
    written, and holds what is written."""
    pool = ReqToTokenPool(size=6, max_context_len=5000, device="cpu")
    assert pool.host_table.shape == (7, 5000) and pool.host_table.dtype == np.int32
    assert not pool.host_table[[0, 3, 6]].any()
    pool.write(5, 4990, torch.arange(10))
    assert pool.host_table[5, 4990:].tolist() == list(range(10))
    assert pool.read_row(5, 5000)[4990:].tolist() == list(range(10))
    assert not pool.host_table[4].any() and not pool.host_table[6].any()
