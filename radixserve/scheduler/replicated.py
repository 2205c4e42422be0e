"""Tensor parallelism in the scheduler: every rank runs the same Scheduler, in lockstep.

Rank 0 receives the requests. Each call that changes the scheduler's state (a request added,
an abort, a cache flush, a turn) is applied on rank 0 at once and logged; at each turn rank 0
broadcasts the log, ending with the turn itself, over the control channel (gloo, pickled), and
every other rank (`follow`) applies the same calls in the same order. The scheduler is
deterministic given its inputs, so every rank admits, chunks, retracts and batches alike, and the
model's collectives meet. Sampled ids agree because the model gathers the whole vocabulary's
logits on every rank and broadcasts random draws (ModelRunner._sample_ids).

The one input that is not deterministic, when a grammar has finished compiling (each rank
compiles its own, on its own clock), is decided by rank 0 and logged like a call ("grammars").

Reads (has_work, model_info, get_internal_state) are rank 0's alone.
"""
from __future__ import annotations

from typing import Any

from radixserve.core.io_struct import BatchTokenIDOut, FlushCacheReply, LoRAUpdateReply, \
    ReqError, TokenizedGenerateReq
from radixserve.distributed.parallel_state import TensorParallelGroup
from radixserve.scheduler.scheduler import Scheduler

# ("add", req) | ("abort", rid) | ("flush",) | ("grammars", done rids, late rids) | ("turn",)
# | ("lora_load", name, path) | ("lora_unload", name, rank 0's success) | ("stop",)
Command = tuple[Any, ...]


class ReplicatedScheduler:
    """Rank 0's view: the Scheduler's interface, mirrored to the other ranks."""

    def __init__(self, scheduler: Scheduler, group: TensorParallelGroup) -> None:
        self.scheduler = scheduler
        self.group = group
        self._log: list[Command] = []

    def add_request(self, msg: TokenizedGenerateReq) -> ReqError | None:
        self._log.append(("add", msg))
        return self.scheduler.add_request(msg)

    def abort_request(self, rid: str) -> None:
        self._log.append(("abort", rid))
        self.scheduler.abort_request(rid)

    def flush_cache(self) -> FlushCacheReply:
        self._log.append(("flush",))
        return self.scheduler.flush_cache()

    def load_lora(self, name: str, path: str) -> LoRAUpdateReply:
        reply = self.scheduler.load_lora(name, path)
        if reply.success:  # the other ranks load it too (a rank that cannot fails loudly)
            self._log.append(("lora_load", name, path))
        return reply

    def unload_lora(self, name: str) -> LoRAUpdateReply:
        # logged even when refused: the unload settles the step in flight, which the other
        # ranks must do too (as a flush)
        reply = self.scheduler.unload_lora(name)
        self._log.append(("lora_unload", name, reply.success))
        return reply

    def run_turn(self) -> list[BatchTokenIDOut]:
        # grammars compile on each rank's own clock: rank 0's view of which are ready decides
        settled = self.scheduler.grammars.poll(self.scheduler.waiting_queue)
        if settled is not None:
            self._log.append(("grammars", *settled))
            _settle_grammars(self.scheduler, *settled)
        self.group.broadcast_object(self._log + [("turn",)])
        self._log = []
        return self.scheduler.run_turn()

    def stop_followers(self) -> None:
        """The other ranks leave `follow` (after applying what is logged, for a clean end)."""
        self.group.broadcast_object(self._log + [("stop",)])
        self._log = []

    def __getattr__(self, name: str) -> Any:  # reads: rank 0's scheduler
        return getattr(self.scheduler, name)


def _settle_grammars(scheduler: Scheduler, done: list[str], late: list[str]) -> None:
    scheduler.grammars.settle(scheduler.waiting_queue, done, late)


def _expect(kind: str, name: str, reply: LoRAUpdateReply, success: bool) -> None:
    """A rank's LoRA update must end as rank 0's did, or it would serve another model."""
    if reply.success != success:
        raise RuntimeError(f"tensor-parallel rank: {kind} {name!r} "
                           f"{'failed' if success else 'succeeded'} where rank 0's did not: "
                           f"{reply.message}")


def follow(scheduler: Scheduler, group: TensorParallelGroup) -> None:
    """Ranks > 0: apply rank 0's calls in order until it says stop."""
    while True:
        for command in group.broadcast_object(None):
            kind = command[0]
            if kind == "add":
                scheduler.add_request(command[1])
            elif kind == "abort":
                scheduler.abort_request(command[1])
            elif kind == "flush":
                scheduler.flush_cache()
            elif kind == "grammars":
                _settle_grammars(scheduler, command[1], command[2])
            elif kind == "lora_load":
                _expect(kind, command[1], scheduler.load_lora(*command[1:]), True)
            elif kind == "lora_unload":
                _expect(kind, command[1], scheduler.unload_lora(command[1]), command[2])
            elif kind == "turn":
                scheduler.run_turn()
            elif kind == "stop":
                return
            else:
                raise ValueError(f"unknown scheduler command {kind!r}")
