"""The scheduler's overlapped decode loop: launch each step before the previous one's ids are
read, and settle (read back, in launch order) the passes in flight.

A mixin of `Scheduler` (the pattern of SGLang's scheduler mixins): the loop moves requests
between the scheduler's lists, so it lives on it; overlap.py holds the passes it launches.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.core.long_rope import LongRopeSwitch, long_rope_due
from radixserve.core.req import Req
from radixserve.scheduler.overlap import (DecodeLauncher, InflightDecode, InflightPrefill,
                                          ends_after_next_token)

if TYPE_CHECKING:
    from radixserve.mem.base_cache import BasePrefixCache


class OverlapLoopMixin:
    running: list[Req]
    context_len: int
    tree_cache: "BasePrefixCache"
    inflight: InflightDecode | None
    inflight_prefill: InflightPrefill | None
    long_rope: LongRopeSwitch | None

    if TYPE_CHECKING:
        def _ensure_decode_memory(self, extra_tokens: int = 0) -> None: ...
        def _decode_memory_available(self, need: int) -> bool: ...
        def _streamed_output_waiting(self) -> bool: ...
        def _process_prefill_results(self, reqs: list[Req], out: Any,
                                     launched: InflightPrefill | None = None) -> None: ...
        def _take_token(self, req: Req, i: int, out: Any) -> bool: ...
        def _after_decode_step(self, batch_size: int, still_running: list[Req]) -> None: ...

    def _run_decode_steps_overlapped(self, launcher: DecodeLauncher, max_steps: int,
                                     keep_prefill: bool = False) -> None:
        """Launch up to max_steps decode steps, each before the previous one's ids are read:
        step k+1 takes its input ids from step k on the device, and while it runs the host
        appends step k's tokens, checks which requests finished and (after the turn) sends the
        output. The last step launched stays in flight across the turn (`self.inflight`); a
        prefill, a retraction, an abort or a synchronous step settles it first (`_settle`).

        Step k+1 leaves out requests whose step-k token is their last by length (or makes them
        move to LongRoPE's long table: they go back to the queue when it is read); a request that
        stops on a token (EOS, stop string) is found one step late: its step-k+1 token is
        dropped and the KV slot that step wrote goes back with the request's other slots.

        keep_prefill (a one-step turn between two chunks of a prompt): the step is launched
        behind the prefill in flight, and both stay in flight. The next turn admits and
        launches the next chunk's batch before the host waits for either, so the GPU is never
        left without a queued pass while Python reads the prefill back (its requests join the
        decode batch at the same step as when it is read here). Then two passes are in flight
        between turns, the prefill launched first; `_settle` reads them in that order."""
        keep_prefill = keep_prefill and max_steps == 1 and self.inflight is None \
            and self.inflight_prefill is not None
        launched_steps = 0
        while True:
            launched = None
            if launched_steps < max_steps:
                reqs = self._next_decode_reqs()
                if not reqs and self.inflight_prefill is not None:
                    self._settle()  # only the prefill's requests are left to decode
                    keep_prefill = False
                    reqs = self._next_decode_reqs()
                if reqs:
                    launched = launcher.launch(reqs, self.inflight)
                    launched_steps += 1
            if not (keep_prefill and launched is not None):
                self._settle()
            self.inflight = launched
            if launched is None or launched_steps >= max_steps or \
                    self._streamed_output_waiting():
                break  # what was launched last runs on while the turn's output goes out

    def _next_decode_reqs(self) -> list[Req]:
        """The requests of the next overlapped decode step: those of the step in flight that go
        on, then the ones whose prefill was read back since (their token is on the host); none
        when the KV pool is short (settle first; the next turn may retract) or when a request
        with a grammar would join (settle; the next turn decodes synchronously)."""
        if self.inflight is None:
            self._ensure_decode_memory()
            reqs = list(self.running)
        else:
            in_step = {id(r) for r in self.inflight.reqs}
            reqs = [r for r in self.inflight.reqs if not r.finished
                    and not ends_after_next_token(r, self.context_len)
                    and not long_rope_due(self.long_rope, r, ahead=1)]
            reqs += [r for r in self.running if id(r) not in in_step]
            if not self._decode_memory_available(len(reqs)):
                return []
        if any(r.grammar is not None for r in reqs):
            return []
        return reqs

    def _settle(self) -> None:
        """Read back and process the passes in flight, in launch order: at most one, or a
        prefill and the decode step launched after it (keep_prefill)."""
        if self.inflight_prefill is not None:
            prefill, self.inflight_prefill = self.inflight_prefill, None
            out = prefill.handle.output([r.top_logprobs_num for r in prefill.reqs])
            self._process_prefill_results(prefill.reqs, out, prefill)
        if self.inflight is None:
            return
        inflight, self.inflight = self.inflight, None
        out = inflight.handle.output([r.top_logprobs_num for r in inflight.reqs])
        left: set[int] = set()  # requests that finished or went back to the queue
        for i, req in enumerate(inflight.reqs):
            if req.finished:  # stopped on the step before; this token is past its end
                continue
            if not self._take_token(req, i, out):
                left.add(id(req))
        self._after_decode_step(len(inflight.reqs), [r for r in self.running if not r.finished
                                                     and id(r) not in left])
