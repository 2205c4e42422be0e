"""Speculative decoding steps (--speculative-algorithm ngram; drafts from ngram_draft.py).

A verify step is one DECODE pass with a row per token: a request with d drafts brings d + 1
rows, its last output (the token without KV) and the drafts, at positions kv_len ..
kv_len + d. Row j's seq_len is kv_len + j + 1, so it attends over its request's tokens up to
itself: the pass is causal across the drafts, writes every row's KV, and runs the decode
kernels and CUDA graphs as they are (a request's req_to_token row may repeat in a batch).

Each row samples its token as plain decoding would at that position (a seeded request's
generator is seeded by its output position: row j's by len(output_ids) + j). The sample of
row j is appended; row j + 1 is read only when that sample equals draft j + 1, since only
then is row j + 1's input what plain decoding would have fed it. With a draft that is one
token (not a distribution), drawing t from p and keeping the draft when t equals it accepts
it with probability p(draft) and otherwise yields p without the draft, renormalised: exactly
speculative sampling's rule, so outputs keep plain decoding's distribution (greedy is the
special case where the sample is the argmax; tests compare the two token for token).

The slots of rows past the first mismatch are freed in the same step, and kv_len counts the
rows kept, so the radix cache only ever sees KV of the request's own tokens. A request that
cannot draft (a grammar, a penalty that depends on the tokens so far, min_new_tokens not yet
reached, one token left) takes one row, as in plain decoding. Drafts are optional: they use
free slots only (never evicting cached prefixes; retraction is only for the plain step's one
slot per request), and are cut so that a pass's rows stay within the largest captured CUDA
graph (trim_drafts).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from radixserve.core.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.core.long_rope import LongRopeSwitch, long_rope_due
from radixserve.core.req import Req
from radixserve.scheduler.batch import BatchBuilder, alloc_kv, rope_shifts
from radixserve.scheduler.ngram_draft import NgramProposer

if TYPE_CHECKING:
    from radixserve.config import ServerArgs
    from radixserve.mem.kv_pool import KVPool
    from radixserve.scheduler.runner_protocol import ModelRunnerLike
    from radixserve.scheduler.stats import SchedulerStats


def make_proposer(args: "ServerArgs", runner: Any) -> NgramProposer | None:
    """The drafter --speculative-algorithm names (None without it); refused for models whose
    layers keep recurrent states, which a rejected draft would leave advanced."""
    if args.speculative_algorithm is None:
        return None
    if getattr(runner, "state_pool", None) is not None:
        raise ValueError("--speculative-algorithm needs a model whose past is all KV cache; "
                         "this model's linear-attention / Mamba layers keep a running state "
                         "that rejected drafts cannot be taken back from")
    spec = os.environ.get("RADIXSERVE_DECODE_CONFIG", "")
    if spec:
        from radixserve.attention.kernels.decode_attention import DecodeKernelConfig
        if DecodeKernelConfig.from_spec(spec).early_kv:
            raise ValueError("RADIXSERVE_DECODE_CONFIG's early_kv reads a step's earlier "
                             "positions before its own stores finish; a verify pass writes "
                             "several positions of a request: drop early_kv")
    return NgramProposer(args.speculative_num_draft_tokens,
                         args.speculative_ngram_min_match_window_size,
                         args.speculative_ngram_max_match_window_size)


def may_draft(req: Req) -> bool:
    """Whether the request's next tokens can be sampled in one pass from rows built before
    any of them is known: no grammar (its mask follows each token), no penalty counting the
    tokens so far, min_new_tokens reached (its stop mask depends on the output's length)."""
    params = req.sampling_params
    return (req.grammar is None and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0 and params.repetition_penalty == 1.0
            and len(req.output_ids) >= params.min_new_tokens)


def trim_drafts(drafts: list[list[int]], budget: int) -> list[list[int]]:
    """The drafts cut to at most `budget` tokens in all: every request keeps up to one
    common length L (the largest that fits), and the first ones longer than L one more while
    the budget lasts."""
    if sum(map(len, drafts)) <= budget:
        return drafts
    budget = max(budget, 0)
    length = 0
    while sum(min(len(d), length + 1) for d in drafts) <= budget:
        length += 1
    spare = budget - sum(min(len(d), length) for d in drafts)
    out = []
    for draft in drafts:
        extra = 1 if spare > 0 and len(draft) > length else 0
        spare -= extra
        out.append(draft[:length + extra])
    return out


def prepare_verify(builder: BatchBuilder, reqs: list[Req], drafts: list[list[int]]
                   ) -> ModelWorkerBatch:
    """The verify pass: one DECODE row per token (see the module docstring); KV slots for
    every row, recorded in the request table's host copy (the pass writes the device's)."""
    out_cache_loc = alloc_kv(sum(1 + len(d) for d in drafts), builder.token_to_kv_pool,
                             builder.tree_cache)
    row_reqs: list[Req] = []
    table_rows: list[int] = []
    positions: list[int] = []
    input_ids: list[int] = []
    offsets: list[int] = []
    for req, draft in zip(reqs, drafts):
        assert req.req_pool_idx is not None
        for j, token in enumerate([req.output_ids[-1]] + draft):
            row_reqs.append(req)
            table_rows.append(req.req_pool_idx)
            positions.append(req.kv_len + j)
            input_ids.append(token)
            offsets.append(j)
        req.kv_len += 1 + len(draft)
    builder.req_to_token_pool.write_host_positions(table_rows, positions, out_cache_loc)
    info = builder.sampling_info(row_reqs)
    info.seed_steps = [step + offsets[row] for row, step in zip(info.seed_rows, info.seed_steps)]
    return ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=input_ids,
        req_pool_indices=table_rows,
        seq_lens=[p + 1 for p in positions],
        out_cache_loc=out_cache_loc,
        sampling_info=info,
        return_logprob=any(r.return_logprob for r in reqs),
        top_logprobs_nums=[r.top_logprobs_num for r in row_reqs],
        position_offsets=rope_shifts(row_reqs, [p + 1 for p in positions]),
    )


class SpecDecodeMixin:
    """A mixin of `Scheduler` (as kv_pressure.py): the speculative decode step."""
    running: list[Req]
    builder: BatchBuilder
    runner: "ModelRunnerLike"
    token_to_kv_pool: "KVPool"
    stats: "SchedulerStats"
    speculator: NgramProposer | None
    context_len: int
    long_rope: LongRopeSwitch | None

    if TYPE_CHECKING:
        def _ensure_decode_memory(self, extra_tokens: int = 0) -> None: ...
        def _take_token(self, req: Req, i: int, out: Any) -> bool: ...
        def _append_token(self, req: Req, i: int, out: Any) -> int: ...
        def _finish(self, req: Req, reason: Any = None, release: bool = True) -> None: ...
        def _after_decode_step(self, batch_size: int, still_running: list[Req]) -> None: ...
        def _requeue_for_extend(self, req: Req) -> None: ...

    def _drafts_for(self, req: Req) -> list[int]:
        assert self.speculator is not None
        if not may_draft(req):
            return []
        # every kept row appends a token: stay within max_new_tokens and the context
        limit = min(req.remaining_new_tokens(), self.context_len - req.seqlen) - 1
        if self.long_rope is not None:  # a verify pass stays on the request's rope table
            limit = min(limit, self.long_rope.draft_room(req))
        return self.speculator.propose(req, limit)

    def _run_spec_decode_step(self) -> None:
        drafts = [self._drafts_for(req) for req in self.running]
        free = self.token_to_kv_pool.available_size()
        if free < len(self.running):  # drafts never evict: a plain step's slots first
            self._ensure_decode_memory()
            drafts = [[] for _ in self.running]
            free = self.token_to_kv_pool.available_size()
        if not self.running:
            return
        budget = free - len(self.running)
        rows = getattr(self.runner, "decode_graph_rows", None)
        if rows is not None:  # keep the pass within the captured CUDA graphs
            budget = min(budget, rows - len(self.running))
        drafts = trim_drafts(drafts, budget)
        batch = prepare_verify(self.builder, self.running, drafts)
        self._accept_verified(self.runner.forward(batch), batch.out_cache_loc, drafts)

    def _accept_verified(self, out: Any, out_cache_loc: torch.Tensor,
                         drafts: list[list[int]]) -> None:
        still_running: list[Req] = []
        rejected: list[torch.Tensor] = []
        row = accepted = 0
        for req, draft in zip(self.running, drafts):
            rows = 1 + len(draft)
            if not draft:  # plain decoding's row (grammars and jump-forward included)
                if self._take_token(req, row, out):
                    still_running.append(req)
                row += 1
                continue
            kept = 0
            while kept < rows:
                self._append_token(req, row + kept, out)
                kept += 1
                if req.finished or kept == rows or out.next_token_ids[row + kept - 1] \
                        != draft[kept - 1]:
                    break
            accepted += kept - 1
            if kept < rows:  # the KV of rows past the mismatch is not the request's
                rejected.append(out_cache_loc[row + kept:row + rows])
                req.kv_len -= rows - kept
            if req.finished:
                self._finish(req)
            elif long_rope_due(self.long_rope, req):
                self._requeue_for_extend(req)
            else:
                still_running.append(req)
            row += rows
        if rejected:
            self.token_to_kv_pool.free(torch.cat(rejected))
        self.stats.on_verify_step(sum(1 for d in drafts if d), sum(map(len, drafts)), accepted)
        self._after_decode_step(len(self.running), still_running)
