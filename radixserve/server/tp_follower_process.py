"""Tensor-parallel ranks 1..N-1: a process each, running the same scheduler as rank 0 by
following rank 0's calls (scheduler/replicated.py). Started by the server's ProcessGroup and by
the offline Engine; reports ready (after its model loaded) or its traceback through
`status_conn`, and exits non-zero on failure. It ends when rank 0 says stop, or with its parent.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
from typing import Any

from radixserve.config import ServerArgs
from radixserve.server.process_utils import (failure_detail, prepare_child_process,
                                             report_failure, send_status)


def cpu_threads_per_rank(server_args: ServerArgs) -> None:
    """On CPU, the ranks share the cores: each takes its part (OMP_NUM_THREADS wins)."""
    if server_args.tp_size == 1 or not server_args.device.startswith("cpu") \
            or os.environ.get("OMP_NUM_THREADS"):
        return
    import torch
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // server_args.tp_size))


def run_tp_follower_process(server_args: ServerArgs, tp_rank: int,
                            status_conn: multiprocessing.connection.Connection) -> None:
    name = f"tp{tp_rank}"
    prepare_child_process(name, server_args.log_level)
    import logging
    # rank 0 logs the batches; the others only what goes wrong
    logging.getLogger("radixserve.scheduler").setLevel(logging.WARNING)
    try:
        from radixserve.distributed.parallel_state import get_tp_group
        from radixserve.scheduler.replicated import follow
        from radixserve.scheduler.scheduler import Scheduler
        cpu_threads_per_rank(server_args)
        scheduler = Scheduler.build(server_args, tp_rank)
        send_status(status_conn, {"status": "ready"})
        follow(scheduler, get_tp_group())
        scheduler.runner.shutdown()  # type: ignore[attr-defined]
    except SystemExit:
        raise
    except BaseException:
        report_failure(status_conn, name)
        sys.exit(1)


def follower_ranks(server_args: ServerArgs) -> list[int]:
    """The ranks this node runs as followers: all of its ranks but rank 0."""
    return [rank for rank in server_args.local_tp_ranks if rank != 0]


def start_tp_followers(server_args: ServerArgs) -> list[tuple[Any, Any]]:
    """Spawn this node's follower ranks; returns (process, status pipe) pairs."""
    ctx = multiprocessing.get_context("spawn")
    followers = []
    for rank in follower_ranks(server_args):
        recv_conn, send_conn = ctx.Pipe(duplex=False)
        # daemonic: they go with this process, even when it fails before rank 0 joins them
        process = ctx.Process(target=run_tp_follower_process, name=f"radixserve-tp{rank}",
                              args=(server_args, rank, send_conn), daemon=True)
        process.start()
        send_conn.close()
        followers.append((process, recv_conn))
    return followers


def last_status(conn: Any) -> dict[str, Any]:
    """The last message a follower sent through its status pipe ({} when none)."""
    message: dict[str, Any] = {}
    try:
        while conn.poll():
            message = conn.recv()
    except (EOFError, OSError):
        pass
    return message


class FollowerWatch:
    """A follower that dies takes this process down, with its traceback in the log: without
    it rank 0 would wait at the next collective forever (the server's ProcessGroup does the
    same for its children). `stop()` first when ending the followers on purpose."""

    def __init__(self, followers: list[tuple[Any, Any]]) -> None:
        import threading
        self.followers = followers
        self.stopping = threading.Event()
        if followers:
            threading.Thread(target=self._watch, name="tp-follower-watch", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()

    def _watch(self) -> None:
        import logging
        sentinels = {process.sentinel: (process, conn) for process, conn in self.followers}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self.stopping.is_set():
            return
        process, conn = sentinels[ready[0]]
        logging.getLogger(__name__).error(
            "tensor-parallel rank %s died (exit code %s)%s; stopping.", process.name,
            process.exitcode, failure_detail(last_status(conn)))
        os._exit(1)


def run_headless_node(server_args: ServerArgs) -> int:
    """Node n > 0 of a multi-node group: run this node's ranks (followers of rank 0, on node 0)
    until they end. Returns 0 when rank 0 stopped them, 1 when one failed (its traceback is
    logged); SIGTERM / SIGINT stop them."""
    import logging
    import signal
    logger = logging.getLogger(__name__)
    followers = start_tp_followers(server_args)
    logger.info("node %d of %d: ranks %s following node 0 at %s", server_args.node_rank,
                server_args.nnodes, follower_ranks(server_args), server_args.dist_init_addr)

    def stop(signum: int, _frame: Any) -> None:
        for process, _ in followers:
            process.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    for process, conn in followers:
        process.join()
        if process.exitcode != 0:
            code = 1
            logger.error("rank %s ended with exit code %s%s", process.name,
                         process.exitcode, failure_detail(last_status(conn)))
    return code
