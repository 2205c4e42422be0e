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
