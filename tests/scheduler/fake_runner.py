"""A model runner with real pools and a fake model, for scheduler tests.

The fake "model" predicts next = f(last token, position), so outputs do not depend on batching.
Its "KV cache" stores each token id at its KV slot; every forward checks that the request's
req_to_token row reads back exactly the tokens of its sequence — any slot mix-up by the scheduler
or the radix cache fails the test on the spot.
"""
from __future__ import annotations

from typing import Callable

import torch

from radixserve.config import ServerArgs
from radixserve.core.io_struct import TokenizedGenerateReq
from radixserve.core.req import FIRST_TOKEN_TIME_KEY
from radixserve.core.sampling_params import SamplingParams
from radixserve.core.forward_batch import ModelWorkerBatch
from radixserve.executor.model_runner import ForwardOutput, ModelRunner
from radixserve.executor.pending_step import PendingStep
from radixserve.mem.kv_pool import KVCacheSpec, make_kv_pool
from radixserve.mem.req_to_token_pool import ReqToTokenPool
from radixserve.scheduler.scheduler import Scheduler

VOCAB = 50
EOS = 0


def next_token(last: int, position: int) -> int:
    return 1 + (31 * last + 7 * position) % (VOCAB - 1)  # never EOS


def cyclic_next_token(last: int, position: int) -> int:
    """A rule without the position: every sequence soon repeats itself (n-gram drafts hit)."""
    return 1 + (7 * last + 3) % (VOCAB - 1)


class FakeRunner:
    def __init__(self, max_total_tokens: int, max_reqs: int = 16, context_len: int = 256,
                 rule: Callable[[int, int], int] | None = None) -> None:
        # None: the module's next_token, looked up per call (tests monkeypatch it)
        self.rule = rule
        self.device = torch.device("cpu")
        self.vocab_size = VOCAB
        self.max_total_num_tokens = max_total_tokens
        self.max_num_reqs = max_reqs
        self.req_to_token_pool = ReqToTokenPool(max_reqs, context_len + 4, "cpu")
        self.token_to_kv_pool = make_kv_pool(
            max_total_tokens, KVCacheSpec("mha", 1, 1, 1, torch.float32), "cpu")
        self.slot_token = torch.full((max_total_tokens + 1,), -1, dtype=torch.int64)
        self.sequences: dict[int, list[int]] = {}  # row -> tokens whose KV must exist
        self.batches: list[ModelWorkerBatch] = []
        self.async_steps = 0  # decode steps launched through forward_decode_async
        self.async_prefills = 0  # prefill passes launched through forward_extend_async
        # carried decode steps (ids from the step in flight) that some requests joined
        self.joined_steps = 0
        self.last_decode_rows: set[int] = set()

    def forward(self, batch: ModelWorkerBatch) -> ForwardOutput:
        return ForwardOutput(self._run(batch, batch.input_ids))

    def forward_decode_async(self, batch: ModelWorkerBatch,
                             input_ids: torch.Tensor | None = None) -> PendingStep:
        """As ModelRunner's: `input_ids`, when given, replaces batch.input_ids (stale then)."""
        assert ModelRunner.can_overlap(batch)
        self.async_steps += 1
        rows = set(batch.req_pool_indices)
        if input_ids is not None and rows - self.last_decode_rows:
            self.joined_steps += 1
        self.last_decode_rows = rows
        ids = batch.input_ids if input_ids is None else input_ids.tolist()
        return PendingStep(torch.tensor(self._run(batch, ids), dtype=torch.int64))

    def forward_extend_async(self, batch: ModelWorkerBatch) -> PendingStep:
        """As ModelRunner's: the pass runs at once here; the scheduler reads its ids later."""
        assert ModelRunner.can_overlap(batch) and not batch.forward_mode.is_decode()
        self.async_prefills += 1
        return PendingStep(torch.tensor(self._run(batch, batch.input_ids), dtype=torch.int64))

    def _run(self, batch: ModelWorkerBatch, input_ids: list[int]) -> list[int]:
        self.batches.append(batch)
        if batch.forward_mode.is_decode():  # as the ModelRunner does for every DECODE pass
            self.req_to_token_pool.write_decode_slots(
                torch.tensor(batch.req_pool_indices), torch.tensor(batch.seq_lens),
                batch.out_cache_loc)
        self.slot_token[batch.out_cache_loc] = torch.tensor(input_ids)
        out: list[int] = []
        offset = 0
        for i, row in enumerate(batch.req_pool_indices):
            seq_len = batch.seq_lens[i]
            n = 1 if batch.forward_mode.is_decode() else batch.extend_seq_lens[i]
            slots = self.req_to_token_pool.req_to_token[row, :seq_len].to(torch.int64)
            # the scheduler's host copy of the table (what it frees from) must agree
            assert slots.tolist() == self.req_to_token_pool.host_table[row, :seq_len].tolist()
            kv_tokens = self.slot_token[slots].tolist()
            assert kv_tokens[-n:] == input_ids[offset:offset + n]
            assert -1 not in kv_tokens, f"row {row} reads an unwritten slot"
            rule = self.rule or next_token
            out.append(rule(kv_tokens[-1], seq_len - 1))
            self.check_prefix_consistent(kv_tokens)
            offset += n
        return out

    def check_prefix_consistent(self, kv_tokens: list[int]) -> None:
        """The tokens read back must follow the fake model's own rule after the prompt: we
        cannot know the prompt here, so only check the sequence is a real token list."""
        assert all(0 <= t < VOCAB for t in kv_tokens)


def make_scheduler(max_total_tokens: int = 2000, max_reqs: int = 16, context_len: int = 256,
                   rule: Callable[[int, int], int] | None = None,
                   **args) -> tuple[Scheduler, FakeRunner]:
    runner = FakeRunner(max_total_tokens, max_reqs, context_len, rule)
    server_args = ServerArgs(device="cpu", **args)
    return Scheduler(server_args, runner, None, {EOS}, context_len), runner


def expected_output(prompt: list[int], n: int,
                    rule: Callable[[int, int], int] | None = None) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append((rule or next_token)(seq[-1], len(seq) - 1))
    return seq[len(prompt):]


def make_req(rid: str, prompt: list[int], max_new: int = 8, stream: bool = False,
             **params) -> TokenizedGenerateReq:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0, **params)
    sp.verify()
    sp.normalize()
    return TokenizedGenerateReq(rid=rid, input_text=None, input_ids=prompt, sampling_params=sp,
                                stream=stream)


def run_all(scheduler: Scheduler, max_turns: int = 10000) -> dict[str, dict]:
    """Run until idle; collect output ids and finish reasons per rid."""
    results: dict[str, dict] = {}
    for _ in range(max_turns):
        if not scheduler.has_work():
            break
        for out in scheduler.run_turn():
            for i, rid in enumerate(out.rids):
                entry = results.setdefault(rid, {"ids": [], "finish": None, "messages": 0})
                entry["ids"] += out.new_output_ids[i]
                entry["messages"] += 1
                if out.finished_reasons[i] is not None:
                    entry["finish"] = out.finished_reasons[i]
                    meta = dict(out.meta_infos[i])
                    # a wall-clock time: set once a token was sampled, never the same twice
                    first_token_time = meta.pop(FIRST_TOKEN_TIME_KEY, None)
                    assert (first_token_time is not None) == bool(entry["ids"])
                    entry["meta"] = meta
    assert not scheduler.has_work(), "scheduler did not go idle"
    return results


def assert_memory_clean(scheduler: Scheduler) -> None:
    ok, leaked = scheduler.check_memory()
    assert ok and leaked == 0
    scheduler.tree_cache.check_invariants()
