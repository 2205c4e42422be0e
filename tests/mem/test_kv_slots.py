"""KV slot allocation: every slot is handed out once until freed, frees are kept as a short
list of pieces (a free costs what it frees, not the whole free list), and takes join them."""
from __future__ import annotations

import math
import random

import torch

from radixserve.mem.kv_pool import KVCacheSpec, make_kv_pool


def test_alloc_and_free_keep_every_slot_exactly_once() -> None:
    size = 5000
    pool = make_kv_pool(size, KVCacheSpec("mha", 1, 1, 4, torch.float32), "cpu")
    rng = random.Random(0)
    held: list[torch.Tensor] = []
    most_pieces = 0
    for _ in range(3000):
        if held and (rng.random() < 0.5 or pool.available_size() < 50):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            taken = pool.alloc(rng.randrange(1, 50))
            assert taken is not None
            held.append(taken)
        most_pieces = max(most_pieces, len(pool._freed))
        in_use = sum(t.numel() for t in held)
        assert pool.available_size() == size - in_use
    assert most_pieces <= math.log2(size) + 2  # geometric pieces, never one per free
    everything = torch.cat([pool.free_slots, *held]).tolist()
    assert sorted(everything) == list(range(1, size + 1))
    assert pool.alloc(size + 1) is None
