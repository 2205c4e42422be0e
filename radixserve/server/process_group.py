"""Start, watch and stop the server's child processes (scheduler, detokenizer).

Children are started with the "spawn" method. Each reports through its own pipe: ready (the
scheduler adds the model info) or the traceback of what failed. After start-up a watchdog thread
waits on the children's sentinels; if any child dies while the server is not stopping, the
watchdog reports it (with the child's traceback when it sent one), and the server exits non-zero.
Children end themselves if the parent dies (process_utils.exit_when_parent_dies).
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from radixserve.config import ServerArgs
from radixserve.server.scheduler_process import SchedulerFactory, run_scheduler_process
from radixserve.server.tp_follower_process import follower_ranks, run_tp_follower_process
from radixserve.server.detokenizer_manager import run_detokenizer_process
from radixserve.server.ipc import PortArgs

logger = logging.getLogger(__name__)


_STATUS_PIPE = object()  # where a child's arguments take the write end of its status pipe


class ChildFailedError(RuntimeError):
    """A child process failed or died; the message holds its traceback when it sent one."""


@dataclass
class ChildProcess:
    name: str
    process: multiprocessing.process.BaseProcess
    status_conn: multiprocessing.connection.Connection
    ready_message: dict[str, Any] | None = None

    def read_status(self) -> dict[str, Any] | None:
        try:
            if self.status_conn.poll():
                return self.status_conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def failure_text(self) -> str:
        message = self.read_status()
        code = self.process.exitcode
        text = f"the {self.name} process died (exit code {code})"
        if message and message.get("status") == "error":
            text += f":\n{message.get('traceback', '')}"
        return text


class ProcessGroup:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs,
                 scheduler_factory: SchedulerFactory | None = None) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.scheduler_factory = scheduler_factory
        self.children: list[ChildProcess] = []
        self.stopping = False

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        targets: list[tuple[str, Callable[..., None], tuple[Any, ...]]] = [
            ("detokenizer", run_detokenizer_process,
             (self.server_args, self.port_args, _STATUS_PIPE))]
        # per data-parallel replica: its scheduler (tensor-parallel rank 0) and the ranks that
        # follow it, on the replica's own GPUs
        for dp_rank in range(self.server_args.dp_size):
            args = self.server_args.for_replica(dp_rank) if self.server_args.dp_size > 1 \
                else self.server_args
            prefix = "" if dp_rank == 0 else f"dp{dp_rank}-"
            targets.append((f"{prefix}scheduler", run_scheduler_process,
                            (args, self.port_args, _STATUS_PIPE, self.scheduler_factory,
                             dp_rank)))
            targets += [(f"{prefix}tp{rank}", run_tp_follower_process,
                         (args, rank, _STATUS_PIPE)) for rank in follower_ranks(args)]
        for name, target, args in targets:
            recv_conn, send_conn = ctx.Pipe(duplex=False)
            args = tuple(send_conn if a is _STATUS_PIPE else a for a in args)
            process = ctx.Process(target=target, name=f"radixserve-{name}", args=args)
            process.start()
            send_conn.close()  # the child holds the only write end: EOF means it is gone
            self.children.append(ChildProcess(name, process, recv_conn))

    def pid_of(self, name: str) -> int | None:
        for child in self.children:
            if child.name == name:
                return child.process.pid
        return None

    def wait_ready(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Block until every child is ready; return the scheduler's model info."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = {c.name: c for c in self.children}
        while pending:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            handles: list[Any] = [c.status_conn for c in pending.values()]
            handles += [c.process.sentinel for c in pending.values()]
            if not multiprocessing.connection.wait(handles, timeout=remaining):
                raise ChildFailedError(f"timed out waiting for {sorted(pending)} to start")
            for name, child in list(pending.items()):
                message = child.read_status()
                if message is not None and message.get("status") == "ready":
                    child.ready_message = message
                    del pending[name]
                elif message is not None or not child.process.is_alive():
                    child.process.join(timeout=5)
                    text = f"the {name} process failed to start (exit code " \
                           f"{child.process.exitcode})"
                    if message and message.get("traceback"):
                        text += f":\n{message['traceback']}"
                    raise ChildFailedError(text)
        scheduler = next(c for c in self.children if c.name == "scheduler")
        return dict(scheduler.ready_message["model_info"])  # type: ignore[index]

    def pids_of_schedulers(self) -> list[int | None]:
        """Each data-parallel replica's scheduler process, in replica order."""
        return [self.pid_of("scheduler" if r == 0 else f"dp{r}-scheduler")
                for r in range(self.server_args.dp_size)]

    def start_watchdog(self, on_failure: Callable[[str], None]) -> None:
        def watch() -> None:
            sentinels = {c.process.sentinel: c for c in self.children}
            ready = multiprocessing.connection.wait(list(sentinels))
            if self.stopping:
                return
            child = sentinels[ready[0]]
            child.process.join(timeout=5)
            on_failure(child.failure_text())

        threading.Thread(target=watch, name="child-watchdog", daemon=True).start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every child (SIGTERM, then SIGKILL after `timeout_s`) and remove the sockets."""
        self.stopping = True
        for child in self.children:
            if child.process.is_alive():
                child.process.terminate()
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            child.process.join(timeout=max(deadline - time.monotonic(), 0.1))
            if child.process.is_alive():
                logger.warning("%s process did not stop; killing it", child.name)
                child.process.kill()
                child.process.join(timeout=5)
        self.port_args.cleanup()
