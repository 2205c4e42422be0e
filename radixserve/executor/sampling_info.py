"""SamplingBatchInfo: the sampling parameters of one batch, as device tensors.

Built once per forward pass from the batch's requests (`from_reqs`), read by the Sampler.
Invariants:
  * one row per request, in batch order; logits handed to the Sampler have the same rows.
  * greedy rows (temperature 0 or top_k 1) are sampled by argmax of the penalised logits; their
    rows in temperatures / top_ps / top_ks / min_ps hold neutral values (1, 1, vocab, 0) so they
    never force the sort on a batch whose sampled rows do not need it.
  * the need_* flags are host booleans: they decide which kernels run without a device sync.
  * a request with a seed draws its noise from a generator seeded by (seed, len(output_ids)), so
    its token depends only on its own logits, seed and step: not on the batch around it, and not
    on whether it was retracted and recomputed.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixserve.executor.penalties import BatchPenalties

if TYPE_CHECKING:
    from radixserve.core.req import Req

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """A 64-bit mixing function: nearby inputs give unrelated outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request at output position `step` (= len(output_ids))."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


@functools.lru_cache(maxsize=1024)
def _greedy_rows(bs: int, vocab_size: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperatures, top_ps, top_ks, min_ps, greedy_mask) of an all-greedy batch: shared,
    read-only tensors (the Sampler never writes into its info)."""
    return (torch.ones((bs, 1), dtype=torch.float32, device=device),
            torch.ones(bs, dtype=torch.float32, device=device),
            torch.full((bs,), vocab_size, dtype=torch.int64, device=device),
            torch.zeros(bs, dtype=torch.float32, device=device),
            torch.ones(bs, dtype=torch.bool, device=device))


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [bs, 1] float32 (1.0 on greedy rows)
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64, vocab_size where disabled
    min_ps: torch.Tensor  # [bs] float32
    greedy_mask: torch.Tensor  # [bs] bool
    vocab_size: int
    device: torch.device
    is_all_greedy: bool
    has_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    # the largest top_k of the sampled rows; vocab_size when some sampled row has none
    max_top_k: int
    # seeded, non-greedy rows: row index, user seed, and len(output_ids) at this step
    seed_rows: list[int] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    seed_steps: list[int] = field(default_factory=list)
    penalties: BatchPenalties | None = None
    # host copy of which rows are greedy (greedy_mask on the host: `filter` needs no sync)
    greedy_rows: frozenset[int] = frozenset()
    # constrained decoding: xgrammar's token bitmask, int32 [bs, ceil(vocab / 32)] on the
    # device (all ones on unconstrained rows), or None when no row is constrained. Set by the
    # scheduler per step; a step's mask depends on the token before it, so a batch with a
    # mask is never carried over by filter/advance (the scheduler decodes it synchronously)
    vocab_mask: torch.Tensor | None = None

    @property
    def modifies_logits(self) -> bool:
        """Whether sampling changes the raw logits first (penalties, a grammar's mask): then
        the argmax of the raw logits is not the greedy sample."""
        return self.penalties is not None or self.vocab_mask is not None

    @property
    def batch_size(self) -> int:
        return int(self.top_ps.shape[0])

    @classmethod
    def from_reqs(cls, reqs: Sequence["Req"], vocab_size: int, device: torch.device | str,
                  eos_token_ids: Iterable[int] = ()) -> "SamplingBatchInfo":
        """Build the batch's tensors. `reqs[i].sampling_params` must be verify()ed and
        normalize()d. `eos_token_ids` is only used by min_new_tokens. One host-to-device copy
        for the per-row parameters; penalty tensors only when some request uses a penalty."""
        device = torch.device(device)
        if all(req.sampling_params.is_greedy for req in reqs):
            # the usual serving batch: neutral rows, cached per (size, device): no copy at all
            return cls(*_greedy_rows(len(reqs), vocab_size, device), vocab_size=vocab_size,
                       device=device, is_all_greedy=True, has_greedy=bool(reqs),
                       need_top_p=False, need_top_k=False, need_min_p=False,
                       max_top_k=vocab_size,
                       penalties=BatchPenalties.build(reqs, vocab_size, device, eos_token_ids),
                       greedy_rows=frozenset(range(len(reqs))))
        rows: list[tuple[float, float, float, float, float]] = []
        seed_rows: list[int] = []
        seeds: list[int] = []
        seed_steps: list[int] = []
        need_top_p = need_top_k = need_min_p = False
        num_greedy = 0
        greedy_rows: list[int] = []
        max_top_k = 0
        for i, req in enumerate(reqs):
            params = req.sampling_params
            if params.is_greedy:
                num_greedy += 1
                greedy_rows.append(i)
                rows.append((1.0, 1.0, 0.0, float(vocab_size), 1.0))
                continue
            top_k = vocab_size if params.top_k < 0 else min(params.top_k, vocab_size)
            need_top_k |= top_k < vocab_size
            max_top_k = max(max_top_k, top_k)
            need_top_p |= params.top_p < 1.0
            need_min_p |= params.min_p > 0.0
            rows.append((float(params.temperature), float(params.top_p), float(params.min_p),
                         float(top_k), 0.0))
            if params.seed is not None:
                seed_rows.append(i)
                seeds.append(params.seed)
                seed_steps.append(len(req.output_ids))
        # top_k <= vocab_size < 2**24 is exact in float32, so one packed tensor carries all
        packed = torch.tensor(rows, dtype=torch.float32).reshape(-1, 5)
        packed = packed.to(device, non_blocking=True)
        return cls(
            temperatures=packed[:, 0:1],
            top_ps=packed[:, 1],
            min_ps=packed[:, 2],
            top_ks=packed[:, 3].to(torch.int64),
            greedy_mask=packed[:, 4] > 0.5,
            vocab_size=vocab_size,
            device=device,
            is_all_greedy=num_greedy == len(rows),
            has_greedy=num_greedy > 0,
            need_top_p=need_top_p,
            need_top_k=need_top_k,
            need_min_p=need_min_p,
            max_top_k=max_top_k if max_top_k > 0 else vocab_size,
            seed_rows=seed_rows,
            seeds=seeds,
            seed_steps=seed_steps,
            penalties=BatchPenalties.build(reqs, vocab_size, device, eos_token_ids),
            greedy_rows=frozenset(greedy_rows),
        )

    def seeded_generators(self) -> list[tuple[int, torch.Generator]]:
        """(row, generator) for every seeded row, seeded for this step."""
        gens = []
        for row, seed, step in zip(self.seed_rows, self.seeds, self.seed_steps):
            gen = torch.Generator(device=self.device)
            gen.manual_seed(step_seed(seed, step))
            gens.append((row, gen))
        return gens

    def filter(self, rows: list[int], index: torch.Tensor | None = None) -> "SamplingBatchInfo":
        """The info of a batch made of rows `rows` of this one, in that order (the requests of
        the next decode step when some have left). No host sync. `index`: `rows` already on
        the device, when the caller has it."""
        if index is None:
            index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        new_row = {old: new for new, old in enumerate(rows)}
        kept = [i for i, row in enumerate(self.seed_rows) if row in new_row]
        greedy_rows = frozenset(new_row[r] for r in self.greedy_rows if r in new_row)
        return SamplingBatchInfo(
            temperatures=self.temperatures.index_select(0, index),
            top_ps=self.top_ps.index_select(0, index),
            top_ks=self.top_ks.index_select(0, index),
            min_ps=self.min_ps.index_select(0, index),
            greedy_mask=self.greedy_mask.index_select(0, index),
            vocab_size=self.vocab_size, device=self.device,
            is_all_greedy=len(greedy_rows) == len(rows), has_greedy=bool(greedy_rows),
            # the filters' flags may now be looser than needed: the kept rows' neutral values
            # make the extra work a no-op
            need_top_p=self.need_top_p, need_top_k=self.need_top_k, need_min_p=self.need_min_p,
            max_top_k=self.max_top_k,
            seed_rows=[new_row[self.seed_rows[i]] for i in kept],
            seeds=[self.seeds[i] for i in kept],
            seed_steps=[self.seed_steps[i] for i in kept],
            penalties=None if self.penalties is None else self.penalties.filter(index),
            greedy_rows=greedy_rows,
            vocab_mask=None if self.vocab_mask is None else self.vocab_mask.index_select(0, index))

    def concat(self, other: "SamplingBatchInfo") -> "SamplingBatchInfo":
        """The info of a batch made of this one's rows, then `other`'s (requests joining a
        decode batch whose state is carried on the device). No host sync."""
        if self.vocab_mask is not None or other.vocab_mask is not None:
            raise ValueError("a batch with a grammar's mask is rebuilt each step, not joined")
        n = self.batch_size
        return SamplingBatchInfo(
            temperatures=torch.cat((self.temperatures, other.temperatures)),
            top_ps=torch.cat((self.top_ps, other.top_ps)),
            top_ks=torch.cat((self.top_ks, other.top_ks)),
            min_ps=torch.cat((self.min_ps, other.min_ps)),
            greedy_mask=torch.cat((self.greedy_mask, other.greedy_mask)),
            vocab_size=self.vocab_size, device=self.device,
            is_all_greedy=self.is_all_greedy and other.is_all_greedy,
            has_greedy=self.has_greedy or other.has_greedy,
            need_top_p=self.need_top_p or other.need_top_p,
            need_top_k=self.need_top_k or other.need_top_k,
            need_min_p=self.need_min_p or other.need_min_p,
            # an all-greedy side has no sampled rows: its max_top_k (vocab_size) says nothing
            max_top_k=(other.max_top_k if self.is_all_greedy else self.max_top_k
                       if other.is_all_greedy else max(self.max_top_k, other.max_top_k)),
            seed_rows=self.seed_rows + [n + row for row in other.seed_rows],
            seeds=self.seeds + other.seeds,
            seed_steps=self.seed_steps + other.seed_steps,
            penalties=BatchPenalties.concat(self.penalties, other.penalties, n,
                                            other.batch_size),
            greedy_rows=self.greedy_rows | frozenset(n + row for row in other.greedy_rows))

    def advance(self, next_token_ids: torch.Tensor) -> None:
        """After a decode step appended `next_token_ids` (one per row), bring the info up to date
        for the next step without rebuilding it (no host sync). Only valid while the batch keeps
        the same requests in the same order; rebuild with from_reqs otherwise."""
        self.seed_steps = [step + 1 for step in self.seed_steps]
        if self.penalties is not None:
            self.penalties.advance(next_token_ids)
