"""How the tensor-parallel ranks meet, checked before the group forms.

Rank 0 hosts a TCPStore at --dist-init-addr. Every other rank waits until that address listens
(a node started before node 0 waits, saying so), connects, and writes what it was started with:
its `fingerprint` (the model's config and a sample of its weights, the parallel layout, the
dtypes), once per rank and once per node. Rank 0 compares each node's and each rank's with its
own and writes a verdict: empty, or what differs. So a node started with another --tp-size,
--nnodes or model fails at once with that message on every node, instead of waiting out the
timeout in silence (ranks that disagree on the group's size never meet) or serving garbage
(ranks of different weights do meet). Every wait logs its progress and ends, past the timeout
(--dist-timeout), with an error that says who did not come.

The same store then backs the process group (`init_process_group(store=...)`).
"""
from __future__ import annotations

import datetime
import json
import logging
import socket
import time
from typing import Any, Callable

import torch.distributed as dist

logger = logging.getLogger(__name__)

RANK_KEY = "radixserve/rank/{}"
NODE_KEY = "radixserve/node/{}"
VERDICT_KEY = "radixserve/verdict"
PROGRESS_EVERY_S = 30.0
POLL_S = 0.2
VERDICT_GRACE_S = 10.0
VERDICT_READ_S = 5 * POLL_S


class RendezvousError(RuntimeError):
    """The ranks could not form the group: the message says why, for the operator."""

    show_traceback = False  # (server/process_utils.report_failure logs the message alone)


def meet(host: str, port: int, rank: int, size: int, nnodes: int,
         fingerprint: dict[str, Any], timeout_s: float) -> dist.TCPStore:
    """Join the ranks at host:port as `rank` of `size` (spread evenly over `nnodes` nodes);
    returns the store once rank 0 has found every rank started alike."""
    deadline = time.monotonic() + timeout_s
    where = f"{host}:{port}"
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = _listen(host, port, timeout)
    else:
        _wait_until_listening(host, port, deadline, timeout_s)
    try:
        if rank != 0:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
            # rank 0 started before this rank could connect, so its own deadline falls
            # within timeout_s of now: wait that long for its verdict, however long this
            # rank waited for it to listen
            deadline = time.monotonic() + timeout_s
        return _meet(store, rank, size, nnodes, fingerprint, deadline, timeout_s, where)
    except dist.DistNetworkError:
        raise RendezvousError(f"lost rank 0 at {where} while meeting: see node 0's log (it "
                              "refused the group, or stopped)") from None


def _meet(store: dist.TCPStore, rank: int, size: int, nnodes: int,
          fingerprint: dict[str, Any], deadline: float, timeout_s: float,
          where: str) -> dist.TCPStore:
    payload = json.dumps(fingerprint, sort_keys=True)
    ranks_per_node = size // nnodes
    if rank % ranks_per_node == 0:
        store.set(NODE_KEY.format(rank // ranks_per_node), payload)
    store.set(RANK_KEY.format(rank), payload)
    if rank == 0:
        verdict = _judge(store, size, nnodes, fingerprint, deadline, timeout_s, where)
        store.set(VERDICT_KEY, verdict)
        if verdict:  # the others poll for it: let them read it before the store goes
            time.sleep(VERDICT_READ_S)
    else:
        # past the same deadline rank 0 gives up and says so in the verdict: wait for that
        _wait_for(store, [VERDICT_KEY], deadline + VERDICT_GRACE_S, timeout_s,
                  lambda: f"rank 0 at {where} to check the group")
        verdict = store.get(VERDICT_KEY).decode()
    if verdict:
        raise RendezvousError(verdict)
    return store


def _listen(host: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                             timeout=timeout)
    except dist.DistNetworkError as exc:
        raise RendezvousError(
            f"cannot listen on {host}:{port} for the tensor-parallel ranks: "
            f"{_first_line(exc)} (another server there? pick --dist-init-addr)") from None


def _wait_until_listening(host: str, port: int, deadline: float, timeout_s: float) -> None:
    """Until rank 0 (on node 0) listens at host:port; a plain connect, which the store's
    client would retry with a C++ traceback logged per try."""
    _wait(lambda: _listens(host, port), deadline, timeout_s,
          lambda: f"rank 0 to listen at {host}:{port}",
          lambda: f"nothing listens at {host}:{port} after {timeout_s:g} s: start node 0 (rank "
                  "0) with the same --dist-init-addr (--dist-timeout sets the wait)",
          poll_s=1.0)


def _listens(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def _judge(store: dist.TCPStore, size: int, nnodes: int, own: dict[str, Any],
           deadline: float, timeout_s: float, where: str) -> str:
    """Rank 0: '' when every node and rank was started as rank 0 was, else what differs."""
    ranks_per_node = size // nnodes
    parts = [("node", NODE_KEY, list(range(1, nnodes))),
             ("rank", RANK_KEY, list(range(1, size)))]
    for kind, key, members in parts:
        keys = [key.format(m) for m in members]
        try:
            _wait_for(store, keys, deadline, timeout_s,
                      lambda: _missing(store, kind, key, members, ranks_per_node, where))
        except RendezvousError as exc:
            store.set(VERDICT_KEY, str(exc))  # the others, and a late comer, learn why
            time.sleep(VERDICT_READ_S)
            raise
        for member, member_key in zip(members, keys):
            theirs = json.loads(store.get(member_key))
            differences = _differences(own, theirs)
            if differences:
                return (f"{kind} {member} was started unlike rank 0 (node 0): "
                        f"{'; '.join(differences)}. Start every node with the same model "
                        "and parallelism flags")
    return ""


def _missing(store: dist.TCPStore, kind: str, key: str, members: list[int],
             ranks_per_node: int, where: str) -> str:
    absent = [m for m in members if not store.check([key.format(m)])]
    if kind == "rank":
        nodes = sorted({m // ranks_per_node for m in absent})
        return f"ranks {absent} (node(s) {nodes}) to join at {where}"
    return f"node(s) {absent} to join at {where}"


def _wait_for(store: dist.TCPStore, keys: list[str], deadline: float, timeout_s: float,
              describe: Callable[[], str]) -> None:
    """Until every key is set (describe(): what the keys stand for)."""
    _wait(lambda: store.check(keys), deadline, timeout_s, describe,
          lambda: f"gave up waiting for {describe()} after {timeout_s:g} s: start every node "
                  "with the same --dist-init-addr, --nnodes and --tp-size (--dist-timeout sets "
                  "the wait)")


def _wait(ready: Callable[[], bool], deadline: float, timeout_s: float,
          waiting_for: Callable[[], str], give_up: Callable[[], str],
          poll_s: float = POLL_S) -> None:
    """Poll ready() until it holds: "waiting for <waiting_for()>" logged every
    PROGRESS_EVERY_S, RendezvousError(give_up()) past the deadline."""
    started = last_said = time.monotonic()
    while not ready():
        now = time.monotonic()
        if now > deadline:
            raise RendezvousError(give_up())
        if now - last_said >= PROGRESS_EVERY_S:
            logger.info("waiting for %s (%.0f s of %g)", waiting_for(), now - started,
                        timeout_s)
            last_said = now
        time.sleep(min(poll_s, max(deadline - now, 0.0)))


def _differences(own: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    return [f"{name} {theirs.get(name)!r} where rank 0 has {own.get(name)!r}"
            for name in sorted(set(own) | set(theirs)) if own.get(name) != theirs.get(name)]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
