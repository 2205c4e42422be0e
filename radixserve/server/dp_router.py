"""Data parallelism: which replica serves a request (--load-balance-method).

  round_robin     replicas in turn;
  shortest_queue  the replica with the fewest requests in flight (sent, not yet finished);
  cache_aware     the replica whose radix cache most likely holds the longest prefix of the
                  prompt, when that prefix is at least CACHE_THRESHOLD of the prompt and the
                  replicas' loads are within BALANCE_ABS_THRESHOLD requests of each other; else
                  the least loaded one (the rule of SGLang's router, here inside one server).

The router cannot see the replicas' trees; it keeps its own approximation: for each replica,
the prefixes of the prompts it routed there, as hashes of every BLOCK-token prefix (a chained
hash, so block k's hash stands for tokens [0, (k + 1) * BLOCK)), least recently used first out
past MAX_BLOCKS per replica. The longest run of leading blocks a replica knows is its match.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

BLOCK = 16
MAX_BLOCKS = 1 << 18  # per replica: 4M tokens of prompt prefixes
CACHE_THRESHOLD = 0.5
BALANCE_ABS_THRESHOLD = 32


def prefix_block_hashes(input_ids: list[int]) -> list[int]:
    """hash of tokens [0, (k + 1) * BLOCK) for each whole block k."""
    hashes, running = [], 0
    for start in range(0, len(input_ids) - BLOCK + 1, BLOCK):
        running = hash((running, tuple(input_ids[start:start + BLOCK])))
        hashes.append(running)
    return hashes


class _PrefixIndex:
    def __init__(self) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match_blocks(self, hashes: list[int]) -> int:
        matched = 0
        for h in hashes:
            if h not in self.blocks:
                break
            matched += 1
        return matched

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > MAX_BLOCKS:
            self.blocks.popitem(last=False)


class DataParallelRouter:
    def __init__(self, dp_size: int, method: str = "round_robin") -> None:
        self.dp_size = dp_size
        self.method = method
        self.in_flight = [0] * dp_size
        self.owner: dict[str, int] = {}  # rid -> replica, while in flight
        self._turn = itertools.cycle(range(dp_size))
        self._indexes = [_PrefixIndex() for _ in range(dp_size)]

    def route(self, rid: str, input_ids: list[int]) -> int:
        """The replica for a new request (remembered until `finished(rid)`)."""
        if self.dp_size == 1:
            replica = 0
        elif self.method == "round_robin":
            replica = next(self._turn)
        elif self.method == "shortest_queue":
            replica = self._least_loaded()
        else:
            replica = self._cache_aware(input_ids)
        self.owner[rid] = replica
        self.in_flight[replica] += 1
        return replica

    def replica_of(self, rid: str) -> int | None:
        return self.owner.get(rid)

    def finished(self, rid: str) -> None:
        replica = self.owner.pop(rid, None)
        if replica is not None:
            self.in_flight[replica] -= 1

    def _least_loaded(self) -> int:
        return min(range(self.dp_size), key=lambda r: (self.in_flight[r], r))

    def _cache_aware(self, input_ids: list[int]) -> int:
        hashes = prefix_block_hashes(input_ids)
        balanced = max(self.in_flight) - min(self.in_flight) <= BALANCE_ABS_THRESHOLD
        replica = self._least_loaded()
        if balanced and hashes:
            matches = [index.match_blocks(hashes) for index in self._indexes]
            best = max(range(self.dp_size), key=lambda r: (matches[r], -self.in_flight[r]))
            if matches[best] * BLOCK >= CACHE_THRESHOLD * len(input_ids):
                replica = best
        self._indexes[replica].insert(hashes)
        return replica
