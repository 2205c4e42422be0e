"""Launching decode steps ahead of reading their ids (the overlap schedule's one component).

Step k+1 is launched with step k's sampled ids as its inputs, still on the device; while it
runs, the host appends step k's tokens, checks stops and sends output. The scheduler loop owns
the step in flight (`Scheduler.inflight`, an `InflightDecode`) and settles it; this module only
knows how to launch the next step from the one before.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from radixserve.core.req import Req
from radixserve.executor.sampling_info import SamplingBatchInfo
from radixserve.scheduler.batch import BatchBuilder


class InflightDecode(NamedTuple):
    """A launched decode step: its PendingDecode, its requests (row order) and the sampling
    info it ran with."""
    handle: Any
    reqs: list[Req]
    sampling_info: SamplingBatchInfo


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
        """Launch one step of `reqs`. After a step in flight (`prev`), its sampling info is
        carried over (rows kept, then advanced by that step's ids on the device): the
        requests' output lists, from which a fresh info would count penalties and seed steps,
        lack the token in flight."""
        if prev is None:
            batch = self.builder.prepare_decode(reqs)
            return InflightDecode(self.runner.forward_decode_async(batch), reqs,
                                  batch.sampling_info)
        batch = self.builder.prepare_decode(reqs, with_sampling=False)
        input_ids, info = prev.handle.ids, prev.sampling_info
        if len(reqs) != len(prev.reqs):  # some left: keep the rows of the others, in order
            position = {id(r): i for i, r in enumerate(prev.reqs)}
            prev_rows = [position[id(r)] for r in reqs]
            index = torch.tensor(prev_rows, dtype=torch.int64).to(input_ids.device,
                                                                  non_blocking=True)
            input_ids = input_ids.index_select(0, index)
            info = info.filter(prev_rows, index)
        info.advance(input_ids)
        batch.sampling_info = info
        return InflightDecode(self.runner.forward_decode_async(batch, input_ids), reqs, info)
