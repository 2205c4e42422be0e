"""Control requests' replies (/flush_cache, /get_server_info) are matched to their waiters
by replica and order: a replica answers in the order it was asked."""
from __future__ import annotations

import asyncio
from collections import deque

from radixserve.core.io_struct import FlushCacheReply
from radixserve.server.tokenizer_manager import TokenizerManager


def test_a_late_reply_is_dropped_not_handed_to_the_next_waiter() -> None:
    """A reply arriving after its waiter timed out belongs to that waiter: the next request's
    waiter gets its own reply, not the stale one (it got the late one before)."""
    tm = TokenizerManager.__new__(TokenizerManager)  # only the reply matching is exercised
    tm.pending_replies = {FlushCacheReply: deque()}
    loop = asyncio.new_event_loop()
    try:
        timed_out, other_replica, next_one = (loop.create_future() for _ in range(3))
        timed_out.cancel()
        tm.pending_replies[FlushCacheReply].extend(
            [(0, timed_out), (1, other_replica), (0, next_one)])
        tm._handle(FlushCacheReply(False, "late", dp_rank=0))
        assert not next_one.done() and not other_replica.done()
        tm._handle(FlushCacheReply(True, "its own", dp_rank=0))
        assert next_one.result().message == "its own"
        tm._handle(FlushCacheReply(True, "replica 1", dp_rank=1))
        assert other_replica.result().message == "replica 1"
        assert not tm.pending_replies[FlushCacheReply]
    finally:
        loop.close()


def test_a_request_refused_in_one_part_counts_no_abort_for_the_others() -> None:
    """n = 2 (or a batch of prompts) whose second copy the full queue refused (429): the first
    copy, already running, is aborted as the 429 ends the request, and counted as no abort,
    as a request refused alone is not (the lifecycle test saw one such abort now and then)."""
    from radixserve.core.io_struct import ReqError
    from radixserve.server.errors import APIError
    from radixserve.server.request_state import GenerateRequest, ReqState
    from radixserve.server.shared_prefix import WaitingCopies

    class Router:
        def finished(self, rid: str) -> None:
            pass

        def replica_of(self, rid: str) -> None:
            return None

    finishes: list[str] = []
    tm = TokenizerManager.__new__(TokenizerManager)  # only generate_all's ending is exercised
    tm.rid_to_state, tm.waiting, tm.router, tm.send_socks = {}, WaitingCopies(), Router(), []
    tm.metrics = type("Metrics", (), {"observe_finish": lambda self, r, *a: finishes.append(r)})()
    tm.refusing = None
    running, refused = (GenerateRequest(rid=rid, input_ids=[i], input_text=None,
                                        sampling_params=None, stream=False)
                        for i, rid in enumerate(("copy-0", "copy-1")))

    def send(req: GenerateRequest) -> ReqState:  # generate_final sends a copy of the request
        state = tm.rid_to_state[req.rid] = ReqState(req=req)
        if req.rid == refused.rid:
            state.error = ReqError(req.rid, "too many queued requests", http_status=429)
            state.event.set()
        return state

    tm._send = send
    loop = asyncio.new_event_loop()
    try:
        try:
            loop.run_until_complete(tm.generate_all([running, refused]))
        except APIError as exc:
            assert exc.status_code == 429
        else:
            raise AssertionError("the refusal did not end the request")
        loop.run_until_complete(asyncio.sleep(0))  # the running copy's task ends (cancelled)
    finally:
        loop.close()
    assert finishes == [] and tm.rid_to_state == {}
