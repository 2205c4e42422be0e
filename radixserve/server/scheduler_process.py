"""The scheduler's process: a ZMQ event loop around `Scheduler`.

Loop invariant: every turn first drains all pending messages without blocking (so aborts and new
requests are seen between two model steps), then runs one scheduler turn if there is work, and
only blocks on the socket (with a timeout) when the scheduler is idle.

Messages in (from the TokenizerManager): TokenizedGenerateReq, AbortReq, FlushCacheReq,
GetInternalStateReq, LoadLoRAReq, UnloadLoRAReq, or a list of them. Messages out (to the
detokenizer): BatchTokenIDOut from each turn, ReqError for refused requests, FlushCacheReply,
LoRAUpdateReply and InternalState replies, and a
SchedulerStateUpdate every STATE_UPDATE_INTERVAL_S of work and on going idle (the detokenizer
passes everything that is not BatchTokenIDOut through unchanged).
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import zmq

from radixserve.config import ServerArgs
from radixserve.core.io_struct import (AbortReq, FlushCacheReq, GetInternalStateReq,
                                       LoadLoRAReq, SchedulerStateUpdate, TokenizedGenerateReq,
                                       UnloadLoRAReq)
from radixserve.server.ipc import PortArgs, pull_socket, push_socket
from radixserve.server.process_utils import (on_parent_stop, prepare_child_process,
                                             report_failure, send_status)
from radixserve.server.cpu_priority import pin_scheduler_threads
from radixserve.server.tp_follower_process import cpu_threads_per_rank
from radixserve.server.turn_watchdog import TurnWatchdog

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

SchedulerFactory = Callable[[ServerArgs], "Scheduler"]

# how often a working scheduler sends its state unasked (SchedulerStateUpdate, for /metrics)
STATE_UPDATE_INTERVAL_S = 0.5


def build_default_scheduler(server_args: ServerArgs) -> Any:
    """Rank 0's scheduler; with --tp-size N, mirrored to the follower ranks."""
    from radixserve.scheduler.scheduler import Scheduler

    scheduler = Scheduler.build(server_args)
    if server_args.tp_size == 1:
        return scheduler
    from radixserve.distributed.parallel_state import get_tp_group
    from radixserve.scheduler.replicated import ReplicatedScheduler
    return ReplicatedScheduler(scheduler, get_tp_group())


class SchedulerLoop:
    """Owns the scheduler's two sockets; `step()` is one iteration of the event loop."""

    def __init__(self, scheduler: Any, port_args: PortArgs, idle_poll_ms: int = 1000,
                 dp_rank: int = 0, watchdog: TurnWatchdog | None = None) -> None:
        self.scheduler = scheduler
        self.watchdog = watchdog or TurnWatchdog(0)
        self.idle_poll_ms = idle_poll_ms
        self.context = zmq.Context(1)
        self.recv_sock = pull_socket(self.context, port_args.scheduler_inputs[dp_rank])
        self.dp_rank = dp_rank
        self.send_sock = push_socket(self.context, port_args.detokenizer_input)
        self.stopped = False
        self.last_update = float("-inf")  # when the last SchedulerStateUpdate went out
        self.idle_update_sent = False

    def run_forever(self) -> None:
        while not self.stopped:
            self.step()

    def stop(self) -> None:
        """End run_forever after the step in progress (from any thread)."""
        self.stopped = True

    def step(self) -> None:
        for message in self._drain():
            self._dispatch(message)
            self.idle_update_sent = False  # a flush while idle changes the gauges too
        if self.scheduler.has_work():
            self.watchdog.turn_started()
            outs = self.scheduler.run_turn()
            self.watchdog.turn_ended()
            for out in outs:
                self.send_sock.send_pyobj(out)
            self.idle_update_sent = False
            if time.monotonic() - self.last_update >= STATE_UPDATE_INTERVAL_S:
                self._send_state_update()
        else:
            if not self.idle_update_sent:  # the gauges drop to idle values at once
                self._send_state_update()
                self.idle_update_sent = True
            self.recv_sock.poll(timeout=self.idle_poll_ms)

    def _send_state_update(self) -> None:
        state = replace(self.scheduler.get_internal_state(check_memory=False),
                        dp_rank=self.dp_rank)
        self.send_sock.send_pyobj(SchedulerStateUpdate(state))
        self.last_update = time.monotonic()

    def close(self) -> None:
        self.recv_sock.close(linger=0)
        self.send_sock.close(linger=0)
        self.context.term()

    def _drain(self) -> list[Any]:
        messages: list[Any] = []
        while True:
            try:
                message = self.recv_sock.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            messages.extend(message if isinstance(message, list) else [message])

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, TokenizedGenerateReq):
            error = self.scheduler.add_request(message)
            if error is not None:
                self.send_sock.send_pyobj(error)
        elif isinstance(message, AbortReq):
            self.scheduler.abort_request(message.rid)
        elif isinstance(message, FlushCacheReq):
            self.send_sock.send_pyobj(replace(self.scheduler.flush_cache(), dp_rank=self.dp_rank))
        elif isinstance(message, LoadLoRAReq):
            reply = self.scheduler.load_lora(message.name, message.path)
            self.send_sock.send_pyobj(replace(reply, dp_rank=self.dp_rank))
        elif isinstance(message, UnloadLoRAReq):
            reply = self.scheduler.unload_lora(message.name)
            self.send_sock.send_pyobj(replace(reply, dp_rank=self.dp_rank))
        elif isinstance(message, GetInternalStateReq):
            self.send_sock.send_pyobj(replace(self.scheduler.get_internal_state(),
                                              dp_rank=self.dp_rank))
        else:
            logger.error("scheduler got an unknown message %r; ignored", type(message).__name__)


def limit_cpu_threads(server_args: ServerArgs) -> None:
    """On CPU with more than four cores, leave one core to the HTTP and detokenizer processes:
    torch's OpenMP threads spin at barriers, and when they compete with the HTTP process for
    cores small ops slow down badly. With four or fewer, the core is worth more to the model:
    on 2 cores, 64 x 128/128 streamed through HTTP ran at 221 output tok/s with both threads
    and 145 with one (docs/PERFORMANCE.md). OMP_NUM_THREADS wins over both."""
    cores = os.cpu_count() or 1
    if server_args.tp_size > 1:
        cpu_threads_per_rank(server_args)
        return
    if not server_args.device.startswith("cpu") or os.environ.get("OMP_NUM_THREADS") \
            or cores <= 4:
        return
    import torch

    torch.set_num_threads(cores - 1)


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs,
                          status_conn: multiprocessing.connection.Connection,
                          scheduler_factory: SchedulerFactory | None = None,
                          dp_rank: int = 0) -> None:
    """Entry point of the scheduler child (spawned): data-parallel replica `dp_rank`'s (its
    args already the replica's). Reports readiness with the model info, or the traceback of
    whatever failed, through `status_conn`; exits non-zero on failure."""
    prepare_child_process("scheduler" if dp_rank == 0 else f"scheduler-dp{dp_rank}",
                          server_args.log_level)
    loop: SchedulerLoop | None = None
    try:
        limit_cpu_threads(server_args.resolve())
        pin_scheduler_threads(server_args)
        scheduler = (scheduler_factory or build_default_scheduler)(server_args)
        loop = SchedulerLoop(scheduler, port_args, dp_rank=dp_rank,
                             watchdog=TurnWatchdog(server_args.watchdog_timeout))
        stops_followers = hasattr(scheduler, "stop_followers")
        if stops_followers:
            # with tensor parallelism a stop ends the turn in progress, then tells the other
            # ranks (on other nodes too: they end cleanly, not on a broken connection)
            on_parent_stop(loop.stop)
        send_status(status_conn, {"status": "ready", "model_info": dict(scheduler.model_info)})
        loop.run_forever()
        if stops_followers:
            scheduler.stop_followers()
            logger.info("stopped the other tensor-parallel ranks")
    except SystemExit:
        raise
    except BaseException:
        report_failure(status_conn, "scheduler")
        sys.exit(1)
    finally:
        if loop is not None:
            loop.close()
