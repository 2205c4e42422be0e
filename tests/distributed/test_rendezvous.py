"""The tensor-parallel ranks meet at rank 0's store and are checked before the group forms:
ranks started alike meet; a rank or a whole node started with other flags or another model is
refused on every rank with what differs (a node with another --tp-size included, whose ranks
could never meet rank 0's group); a node that never comes, or a rank 0 that never listens, ends
the wait with a message saying so, and progress is logged meanwhile, also for a node started
long before node 0; a busy address is one clear error. Ranks are threads here (the store is the same TCPStore as across machines)."""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import pytest

from radixserve.distributed import rendezvous
from radixserve.distributed.rendezvous import RendezvousError, meet
from tests.server.server_process import free_port

FINGERPRINT = {"tp_size": 2, "nnodes": 2, "model": "abc", "dtype": "torch.float32"}


def _ranks(port: int, ranks: list[tuple[int, int, int, dict[str, Any]]],
           timeout_s: float = 20.0) -> dict[int, Any]:
    """Run meet() for each (rank, size, nnodes, fingerprint) in a thread of its own; rank ->
    the store or the exception it raised."""
    results: dict[int, Any] = {}

    def run(rank: int, size: int, nnodes: int, fingerprint: dict[str, Any]) -> None:
        try:
            results[rank] = meet("127.0.0.1", port, rank, size, nnodes, fingerprint, timeout_s)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[rank] = exc

    threads = [threading.Thread(target=run, args=spec) for spec in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_ranks_started_alike_meet() -> None:
    results = _ranks(free_port(), [(0, 2, 2, FINGERPRINT), (1, 2, 2, dict(FINGERPRINT))])
    assert not any(isinstance(r, Exception) for r in results.values()), results
    assert results[0].get(rendezvous.VERDICT_KEY) == b""


def test_a_rank_with_another_model_is_refused_on_every_rank() -> None:
    other = {**FINGERPRINT, "model": "xyz"}
    results = _ranks(free_port(), [(0, 2, 2, FINGERPRINT), (1, 2, 2, other)])
    for rank in (0, 1):
        assert isinstance(results[rank], RendezvousError)
        assert "node 1 was started unlike rank 0" in str(results[rank])
        assert "model 'xyz' where rank 0 has 'abc'" in str(results[rank])


def test_a_node_started_with_another_tp_size_is_refused_not_waited_for() -> None:
    """Node 1 with --tp-size 4 runs ranks 2 and 3, so rank 1, which rank 0's group of 2
    waits for, never comes; node 1's node entry says why at once."""
    bigger = {**FINGERPRINT, "tp_size": 4}
    results = _ranks(free_port(), [(0, 2, 2, FINGERPRINT), (2, 4, 2, bigger),
                                   (3, 4, 2, bigger)], timeout_s=30.0)
    for rank in (0, 2, 3):
        assert isinstance(results[rank], RendezvousError), results
        assert "tp_size 4 where rank 0 has 2" in str(results[rank])


def test_a_node_that_never_comes_ends_the_wait_with_who_is_missing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(rendezvous, "PROGRESS_EVERY_S", 0.2)
    caplog.set_level(logging.INFO, logger=rendezvous.__name__)
    results = _ranks(free_port(), [(0, 4, 2, FINGERPRINT), (1, 4, 2, FINGERPRINT)],
                     timeout_s=1.5)
    assert isinstance(results[0], RendezvousError)
    assert "gave up waiting for node(s) [1] to join" in str(results[0])
    assert isinstance(results[1], RendezvousError)  # rank 1 learns it from the verdict
    assert "node(s) [1]" in str(results[1])
    assert "waiting for node(s) [1] to join at 127.0.0.1:" in caplog.text


def test_a_rank_0_that_never_listens_ends_the_wait(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(rendezvous, "PROGRESS_EVERY_S", 0.2)
    caplog.set_level(logging.INFO, logger=rendezvous.__name__)
    results = _ranks(free_port(), [(1, 2, 2, FINGERPRINT)], timeout_s=1.5)
    assert isinstance(results[1], RendezvousError)
    assert "nothing listens at 127.0.0.1:" in str(results[1])
    assert "waiting for rank 0 to listen" in caplog.text


def test_a_busy_address_is_one_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousError, match="cannot listen on 127.0.0.1:.*address already "
                                                  "in use.*pick --dist-init-addr"):
            meet("127.0.0.1", port, 0, 2, 1, FINGERPRINT, 5.0)


def test_a_node_started_long_before_node_0_waits_for_its_verdict(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 waits most of its time for rank 0 to listen; rank 0 then waits its own full
    time for node 2, which never comes. Node 1 must still be there for the verdict (giving
    up first, it would leave keys behind that let rank 0 form a group without it)."""
    monkeypatch.setattr(rendezvous, "VERDICT_GRACE_S", 0.1)
    port = free_port()
    results: dict[str, Any] = {}

    def rank(name: str, rank_id: int, delay_s: float) -> None:
        time.sleep(delay_s)
        try:
            results[name] = meet("127.0.0.1", port, rank_id, 3, 3, FINGERPRINT, 3.0)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[name] = exc

    threads = [threading.Thread(target=rank, args=("node 1", 1, 0.0)),
               threading.Thread(target=rank, args=("rank 0", 0, 2.5))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for name in ("rank 0", "node 1"):
        assert isinstance(results[name], RendezvousError), results
        assert "gave up waiting for node(s) [2] to join" in str(results[name]), results
