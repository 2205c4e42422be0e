"""The overlap schedule's parts: passes launched before the host reads their sampled ids.

Decode step k+1 is launched with step k's sampled ids as its inputs, still on the device; a
prefill batch is launched and its ids read only after the scheduler has launched what comes next
(or settled what came before). While a pass runs, the host appends the previous pass's tokens,
checks stops, sends output and builds the next batch. The scheduler loop owns the pass in flight
(`Scheduler.inflight`: an `InflightDecode` or an `InflightPrefill`) and settles it; this module
only describes those passes and launches a decode step from the one before.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from radixserve.core.req import Req
from radixserve.executor.sampling_info import SamplingBatchInfo
from radixserve.scheduler.batch import BatchBuilder


class InflightDecode(NamedTuple):
    """A launched decode step: its PendingStep, its requests (row order) and the sampling
    info it ran with."""
    handle: Any
    reqs: list[Req]
    sampling_info: SamplingBatchInfo


class InflightPrefill(NamedTuple):
    """A launched prefill batch: its PendingStep, its requests (row order), and which of them
    ran an intermediate chunk (recorded at launch: the next chunk's admission changes
    `is_being_chunked` before this pass is read back)."""
    handle: Any
    reqs: list[Req]
    chunk_only: list[bool]


def ends_after_next_token(req: Req, context_len: int) -> bool:
    """True when the token now in flight is the request's last by length (known ahead)."""
    return (len(req.output_ids) + 1 >= req.sampling_params.max_new_tokens
            or req.seqlen + 1 >= context_len)


class DecodeLauncher:
    """Builds and launches decode steps on a runner's `forward_decode_async`."""

    def __init__(self, runner: Any, builder: BatchBuilder) -> None:
        self.runner = runner
        self.builder = builder

    def launch(self, reqs: list[Req], prev: InflightDecode | None) -> InflightDecode:
        """Launch one step of `reqs`. After a step in flight (`prev`), `reqs` lists the rows
        of `prev` that go on (in prev's order), then the requests joining the batch (their
        prefill was read back since prev was launched). The kept rows' sampling info is
        carried over (rows kept, then advanced by that step's ids on the device): the
        requests' output lists, from which a fresh info would count penalties and seed steps,
        lack the token in flight. The joining rows' ids and info come from the host."""
        position = {} if prev is None else {id(r): i for i, r in enumerate(prev.reqs)}
        kept = [r for r in reqs if id(r) in position]
        if prev is None or not kept:
            batch = self.builder.prepare_decode(reqs)
            return InflightDecode(self.runner.forward_decode_async(batch), reqs,
                                  batch.sampling_info)
        joining = reqs[len(kept):]
        if any(a is not b for a, b in zip(reqs, kept)):
            raise ValueError("the kept rows of the step in flight must come first")
        batch = self.builder.prepare_decode(reqs, with_sampling=False)
        input_ids, info = prev.handle.ids, prev.sampling_info
        if len(kept) != len(prev.reqs):  # some left: keep the rows of the others, in order
            prev_rows = [position[id(r)] for r in kept]
            index = torch.tensor(prev_rows, dtype=torch.int64).to(input_ids.device,
                                                                  non_blocking=True)
            input_ids = input_ids.index_select(0, index)
            info = info.filter(prev_rows, index)
        info.advance(input_ids)
        if joining:
            new_ids = torch.tensor([r.output_ids[-1] for r in joining], dtype=torch.int64)
            input_ids = torch.cat((input_ids, new_ids.to(input_ids.device, non_blocking=True)))
            info = info.concat(self.builder.sampling_info(joining))
        batch.sampling_info = info
        return InflightDecode(self.runner.forward_decode_async(batch, input_ids), reqs, info)
