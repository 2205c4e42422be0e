"""Decode with overlap: the Scheduler's decode steps launched ahead of reading their ids.

Step k+1 is launched with step k's sampled ids as its inputs, still on the device; while it
runs, the host appends step k's tokens, checks stops and (after the turn) sends the output. The
last step launched stays in flight across turns in `Scheduler.inflight`; anything that needs
every request's tokens so far (a prefill, a synchronous step, an abort, a flush, a retraction)
calls `_settle` first.

A mixin of Scheduler: it uses the scheduler's args, runner, builder, pools, tree cache,
`running`, `inflight`, `_ensure_decode_memory`, `_append_token`, `_finish`,
`_after_decode_step` and
`_streamed_output_waiting`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from radixserve.core.req import Req
from radixserve.executor.sampling_info import SamplingBatchInfo

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler

    _Base = Scheduler
else:
    _Base = object


class InflightDecode(NamedTuple):
    """A launched decode step: its PendingDecode, its requests (row order) and the sampling
    info it ran with."""
    handle: Any
    reqs: list[Req]
    sampling_info: SamplingBatchInfo


class OverlapDecodeMixin(_Base):
    def _can_overlap_decode(self) -> bool:
        """Overlap needs a runner that can launch a step without waiting."""
        return not self.args.disable_overlap_schedule and \
            hasattr(self.runner, "forward_decode_async")

    def _ends_after_next_token(self, req: Req) -> bool:
        """True when the token now in flight is the request's last by length (known ahead)."""
        return (len(req.output_ids) + 1 >= req.sampling_params.max_new_tokens
                or req.seqlen + 1 >= self.context_len)

    def _run_decode_steps_overlapped(self, max_steps: int) -> None:
        """Launch up to max_steps decode steps, each before the previous one's ids are read:
        step k+1 takes its input ids from step k on the device, and while it runs the host
        appends step k's tokens, checks which requests finished and (after the turn) sends the
        output. The last step launched stays in flight across the turn (`self.inflight`); a
        prefill, a retraction, an abort or a synchronous step settles it first (`_settle`).

        Step k+1 leaves out requests whose step-k token is their last by length; a request that
        stops on a token (EOS, stop string) is found one step late: its step-k+1 token is
        dropped and the KV slot that step wrote goes back with the request's other slots."""
        launched_steps = 0
        while True:
            launched = None
            if launched_steps < max_steps:
                if self.inflight is None:
                    self._ensure_decode_memory()
                    reqs = list(self.running)
                else:
                    reqs = [r for r in self.inflight.reqs
                            if not r.finished and not self._ends_after_next_token(r)]
                    if not self._decode_memory_available(len(reqs)):
                        reqs = []  # short of KV: settle first; the next turn may retract
                if reqs:
                    launched = self._launch_decode(reqs)
                    launched_steps += 1
            self._settle()
            self.inflight = launched
            if launched is None or launched_steps >= max_steps or \
                    self._streamed_output_waiting():
                break  # what was launched last runs on while the turn's output goes out

    def _launch_decode(self, reqs: list[Req]) -> InflightDecode:
        """Launch one step of `reqs`. After a step in flight, its sampling info is carried over
        (rows kept, then advanced by that step's ids on the device): the requests' output lists,
        from which a fresh info would count penalties and seed steps, lack the token in flight."""
        if self.inflight is None:
            batch = self.builder.prepare_decode(reqs)
            return InflightDecode(self.runner.forward_decode_async(batch), reqs,
                                  batch.sampling_info)
        prev = self.inflight
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
        handle = self.runner.forward_decode_async(batch, input_ids)  # type: ignore[attr-defined]
        return InflightDecode(handle, reqs, info)

    def _settle(self) -> None:
        """Read back and process the decode step in flight, if any."""
        if self.inflight is not None:
            inflight, self.inflight = self.inflight, None
            self._process_overlapped_results(inflight.handle, inflight.reqs)

    def _decode_memory_available(self, need: int) -> bool:
        available = self.token_to_kv_pool.available_size()
        if available < need:
            self.tree_cache.evict(need - available)
        return self.token_to_kv_pool.available_size() >= need

    def _process_overlapped_results(self, handle: Any, reqs: list[Req]) -> None:
        out = handle.output([r.top_logprobs_num for r in reqs])
        for i, req in enumerate(reqs):
            if req.finished:  # stopped on the step before; this token is past its end
                continue
            self._append_token(req, i, out)
            if req.finished:
                self._finish(req)
        self._after_decode_step(len(reqs), [r for r in self.running if not r.finished])
