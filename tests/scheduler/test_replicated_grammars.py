"""With tensor parallelism every rank compiles a request's grammar on its own clock; rank 0
decides when it is ready (or too late) and the other ranks follow that decision: a grammar
still compiling does not hold up other requests on any rank, every rank admits alike, and a
rank whose own compile is slower waits for it at the decided turn. Two schedulers on the fake
runner, joined by an in-process control channel in place of gloo."""
from __future__ import annotations

import threading
from collections import deque
from typing import Any

import pytest

from radixserve.scheduler.grammar import manager as manager_module
from radixserve.scheduler.replicated import ReplicatedScheduler, follow
from tests.scheduler.fake_runner import assert_memory_clean, make_req, make_scheduler
from tests.scheduler.test_grammar_scheduling import StubBackend


class _Channel:
    """rank 0's broadcasts, queued for the follower (which reads them after rank 0 is done)."""

    def __init__(self) -> None:
        self.sent: deque[Any] = deque()

    def broadcast_object(self, obj: Any) -> Any:
        if obj is not None:  # rank 0
            self.sent.append(obj)
            return obj
        return self.sent.popleft()


def _rank() -> tuple[Any, StubBackend]:
    scheduler, _ = make_scheduler(tp_size=2)
    backend = StubBackend()
    scheduler.grammars.tokenizer = object()
    scheduler.grammars._backend = backend
    return scheduler, backend


def _record_finishes(scheduler: Any) -> list[tuple[int, str, str]]:
    """(turn, rid, finish reason's type) of every request the scheduler finishes."""
    finishes: list[tuple[int, str, str]] = []
    run_turn = scheduler.run_turn
    turn = [0]

    def recording_turn() -> list:
        outs = run_turn()
        turn[0] += 1
        finishes.extend((turn[0], rid, reason["type"]) for out in outs
                        for rid, reason in zip(out.rids, out.finished_reasons) if reason)
        return outs
    scheduler.run_turn = recording_turn
    return finishes


def _compiled_after_add(add_request: Any, backend: StubBackend, delay_s: float) -> Any:
    """add_request, then the request's grammar compiles on this rank delay_s later."""
    def add(msg: Any) -> Any:
        error = add_request(msg)
        key = msg.sampling_params.grammar_key
        if key is not None:
            threading.Timer(delay_s, backend.futures[key].set_result, ("compiled",)).start()
        return error
    return add


class _TwoRanks:
    """Rank 0 behind a ReplicatedScheduler, and a follower that replays its log afterwards."""

    def __init__(self) -> None:
        self.leader_sched, self.leader_backend = _rank()
        self.follower_sched, self.follower_backend = _rank()
        self.leader_finishes = _record_finishes(self.leader_sched)
        self.follower_finishes = _record_finishes(self.follower_sched)
        self.channel = _Channel()
        self.leader = ReplicatedScheduler(self.leader_sched, self.channel)  # type: ignore

    def turns(self, n: int) -> None:
        for _ in range(n):
            self.leader.run_turn()

    def decisions(self) -> list[tuple]:
        return [c for log in self.channel.sent for c in log if c[0] == "grammars"]

    def follow(self, compile_delay_s: float) -> None:
        """Replay rank 0's log on the follower, whose own compiles end compile_delay_s after
        each request arrives; it must finish the same requests at the same turns."""
        self.leader.stop_followers()
        self.follower_sched.add_request = _compiled_after_add(
            self.follower_sched.add_request, self.follower_backend, compile_delay_s)
        follow(self.follower_sched, self.channel)  # type: ignore[arg-type]
        assert self.follower_finishes == self.leader_finishes
        assert not self.channel.sent
        for scheduler in (self.leader_sched, self.follower_sched):
            assert not scheduler.waiting_queue and not scheduler.running
            assert_memory_clean(scheduler)


@pytest.mark.timeout(60)  # (a rank that waits for its compile hangs here)
def test_rank0_decides_when_a_grammar_is_ready_and_the_followers_admit_alike() -> None:
    ranks = _TwoRanks()
    ranks.leader.add_request(make_req("constrained", [5, 6, 7], regex="a+"))
    ranks.leader.add_request(make_req("plain", [8, 9], max_new=4))
    ranks.turns(12)  # rank 0's grammar still compiles: the plain request runs to its end
    assert [rid for _, rid, _ in ranks.leader_finishes] == ["plain"]
    ranks.leader_backend.futures[("regex", "a+")].set_result("compiled")
    ranks.turns(30)
    assert [(rid, kind) for _, rid, kind in ranks.leader_finishes] == \
        [("plain", "length"), ("constrained", "length")]
    assert ranks.decisions() == [("grammars", ["constrained"], [])]
    # the follower's own compile ends only while it waits at the decided turn
    ranks.follow(compile_delay_s=0.3)


@pytest.mark.timeout(60)
def test_a_grammar_rank0_finds_too_slow_ends_on_every_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = _TwoRanks()
    ranks.leader.add_request(make_req("slow", [5, 6], regex="b+"))
    ranks.leader.add_request(make_req("plain", [8, 9], max_new=3))
    ranks.turns(1)
    monkeypatch.setattr(manager_module, "COMPILE_TIMEOUT_S", 0.0)
    ranks.turns(20)
    assert ranks.decisions() == [("grammars", [], ["slow"])]
    assert sorted((rid, kind) for _, rid, kind in ranks.leader_finishes) == \
        [("plain", "length"), ("slow", "abort")]
    # the follower compiles it at once, in time by its own clock: rank 0's decision stands
    ranks.follow(compile_delay_s=0.0)
