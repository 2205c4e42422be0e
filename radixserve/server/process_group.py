"""Start, watch and stop the server's child processes (scheduler, detokenizer).

Children are started with the "spawn" method, in two steps: `spawn()` starts them, and each
imports the modules its start-up needs (torch, transformers, the scheduler: ~4 s on a 2-core
CPU) and then waits on its release pipe; `release()` lets them run, `shutdown()` ends them before
they load anything. So the server checks the model and the port (launch.py) while the children
import, and a failed check still stops every process before a model is loaded. Each child then
reports through its own status pipe: ready (the scheduler adds the model info) or the traceback
of what failed. After start-up a watchdog thread waits on the children's sentinels; if any
child dies while the server is not stopping, the watchdog reports it (with the child's
traceback when it sent one), and the server exits non-zero.
Children end themselves if the parent dies (process_utils.exit_when_parent_dies).
"""
from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from radixserve.config import ServerArgs
from radixserve.server.scheduler_process import SchedulerFactory, run_scheduler_process
from radixserve.server.tp_follower_process import follower_ranks, run_tp_follower_process
from radixserve.server.detokenizer_manager import run_detokenizer_process
from radixserve.server.ipc import PortArgs
from radixserve.server.process_utils import failure_detail, terminate_only_from_parent

logger = logging.getLogger(__name__)


_STATUS_PIPE = object()  # where a child's arguments take the write end of its status pipe

# what each kind of child imports while it waits for its release (import errors are left to
# the child's own start-up, which reports them)
_MODEL_MODULES = ("torch", "transformers.models.auto.configuration_auto",
                  "radixserve.scheduler.scheduler", "radixserve.executor.model_runner")
_TOKENIZER_MODULES = ("transformers.models.auto.configuration_auto",
                      "transformers.tokenization_utils_base", "radixserve.loader.tokenizer")


def _run_when_released(release_conn: multiprocessing.connection.Connection,
                       preload: tuple[str, ...], target: Callable[..., None],
                       args: tuple[Any, ...]) -> None:
    """A child's first steps: import `preload`, then run `target(*args)` once the server
    releases it, or exit quietly if the server closes the pipe instead (a failed check, a
    stop, or the server's death)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's (prepare_child_process)
    terminate_only_from_parent()  # before the imports below start threads
    for module in preload:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the target imports it again and reports the error
            break
    try:
        released = release_conn.recv() is True
    except (EOFError, OSError):
        released = False
    release_conn.close()
    if not released:
        os._exit(0)
    target(*args)


def replica_prefix(dp_rank: int) -> str:
    """What the names of data-parallel replica dp_rank's processes start with ("dp1-tp1")."""
    return "" if dp_rank == 0 else f"dp{dp_rank}-"


class ChildFailedError(RuntimeError):
    """A child process failed or died; the message holds its traceback when it sent one."""


@dataclass
class ChildProcess:
    name: str
    process: multiprocessing.process.BaseProcess
    status_conn: multiprocessing.connection.Connection
    release_conn: multiprocessing.connection.Connection | None = None
    ready_message: dict[str, Any] | None = None
    is_scheduler: bool = False  # a replica's scheduler (tensor-parallel rank 0)

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
        return f"the {self.name} process died (exit code {code}){failure_detail(message)}"


class ProcessGroup:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs,
                 scheduler_factory: SchedulerFactory | None = None) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.scheduler_factory = scheduler_factory
        self.children: list[ChildProcess] = []
        self.stopping = False

    def spawn(self) -> None:
        """Start the children; each imports what it needs and waits for `release()`."""
        ctx = multiprocessing.get_context("spawn")
        targets: list[tuple[str, Callable[..., None], tuple[Any, ...]]] = [
            ("detokenizer", run_detokenizer_process,
             (self.server_args, self.port_args, _STATUS_PIPE))]
        # per data-parallel replica: its scheduler (tensor-parallel rank 0) and the ranks that
        # follow it, on the replica's own GPUs
        for dp_rank in range(self.server_args.dp_size):
            args = self.server_args.for_replica(dp_rank) if self.server_args.dp_size > 1 \
                else self.server_args
            prefix = replica_prefix(dp_rank)
            targets.append((f"{prefix}scheduler", run_scheduler_process,
                            (args, self.port_args, _STATUS_PIPE, self.scheduler_factory,
                             dp_rank)))
            targets += [(f"{prefix}tp{rank}", run_tp_follower_process,
                         (args, rank, _STATUS_PIPE)) for rank in follower_ranks(args)]
        for name, target, args in targets:
            recv_conn, send_conn = ctx.Pipe(duplex=False)
            release_recv, release_send = ctx.Pipe(duplex=False)
            args = tuple(send_conn if a is _STATUS_PIPE else a for a in args)
            preload = _TOKENIZER_MODULES if name == "detokenizer" else _MODEL_MODULES
            process = ctx.Process(target=_run_when_released, name=f"radixserve-{name}",
                                  args=(release_recv, preload, target, args))
            process.start()
            send_conn.close()  # the child holds the only write end: EOF means it is gone
            release_recv.close()
            self.children.append(ChildProcess(name, process, recv_conn, release_send,
                                              is_scheduler=target is run_scheduler_process))

    def release(self) -> None:
        """Let every spawned child run its start-up (load the model, the tokenizer)."""
        for child in self.children:
            if child.release_conn is not None:
                try:
                    child.release_conn.send(True)
                except (OSError, ValueError):  # it died: wait_ready reports it
                    pass
                child.release_conn.close()
                child.release_conn = None

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
                    text += failure_detail(message)
                    raise ChildFailedError(text)
        scheduler = next(c for c in self.children if c.name == "scheduler")
        return dict(scheduler.ready_message["model_info"])  # type: ignore[index]

    def pids_of_schedulers(self) -> list[int | None]:
        """Each data-parallel replica's scheduler process, in replica order."""
        return [self.pid_of(f"{replica_prefix(r)}scheduler")
                for r in range(self.server_args.dp_size)]

    def follower_pids_per_replica(self) -> list[list[int | None]]:
        """Each data-parallel replica's tensor-parallel followers, in replica order."""
        return [[self.pid_of(f"{replica_prefix(r)}tp{rank}")
                 for rank in follower_ranks(self.server_args)]
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
            if child.release_conn is not None:  # never released: it exits on the closed pipe
                child.release_conn.close()
                child.release_conn = None
        # the schedulers first: with tensor parallelism each tells its other ranks to stop
        # (those on other nodes included), which then end by themselves
        schedulers = [c for c in self.children if c.is_scheduler]
        for wave in (schedulers, [c for c in self.children if c not in schedulers]):
            for child in wave:
                if child.process.is_alive():
                    child.process.terminate()
                    _continue(child.process.pid)
            deadline = time.monotonic() + timeout_s
            for child in wave:
                child.process.join(timeout=max(deadline - time.monotonic(), 0.1))
                if child.process.is_alive():
                    logger.warning("%s process did not stop; killing it", child.name)
                    child.process.kill()
                    child.process.join(timeout=5)
        self.port_args.cleanup()


def _continue(pid: int | None) -> None:
    """SIGCONT after SIGTERM, as shells do for stopped jobs: a child stopped by SIGSTOP (a
    debugger, a test) acts on the SIGTERM only once continued, instead of waiting out the grace
    period for SIGKILL."""
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass
