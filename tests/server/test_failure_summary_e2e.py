"""The shutdown summary of a server whose child died counts the open requests that the
failure ended (each stream got the error event), not only those its own drain ended."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from radixserve.server.launch import one_line_failure
from tests.server.server_process import ServerProcess

HANG_GUARD_S = 120
STREAMS = 2


def _open_long_streams(server: ServerProcess, count: int) -> tuple[list[threading.Thread],
                                                                   list[list[str]]]:
    """`count` streaming completions far longer than the test, each read in a thread into its
    list of SSE data lines; returns once every stream has sent its first event."""
    events: list[list[str]] = [[] for _ in range(count)]
    started = [threading.Event() for _ in range(count)]

    def read(i: int) -> None:
        with requests.post(server.url("/v1/completions"), stream=True, timeout=HANG_GUARD_S,
                           json={"prompt": f"Story {i}:", "max_tokens": 3000, "stream": True,
                                 "ignore_eos": True}) as response:
            for line in response.iter_lines(decode_unicode=True):
                if line.startswith("data: "):
                    events[i].append(line[len("data: "):])
                    started[i].set()

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(HANG_GUARD_S)
    return threads, events


@pytest.mark.slow  # 23 s; a dead scheduler's server-side exit: test_lifecycle_e2e.py, in CI
def test_summary_counts_the_streams_a_dead_rank_ended() -> None:
    server = ServerProcess()
    try:
        threads, events = _open_long_streams(server, STREAMS)
        scheduler = server.server_info()["scheduler_pid"]
        # a control request waiting for the scheduler's answer fails with the server too (it
        # waited for its 60 s timeout, or the connection was cut at the shutdown)
        os.kill(scheduler, signal.SIGSTOP)
        flushed: list[requests.Response] = []
        flusher = threading.Thread(target=lambda: flushed.append(requests.post(
            server.url("/flush_cache"), timeout=HANG_GUARD_S)), daemon=True)
        flusher.start()
        time.sleep(1.0)
        os.kill(scheduler, signal.SIGKILL)
        flusher.join(timeout=HANG_GUARD_S)
        assert flushed and flushed[0].status_code == 503, flushed
        assert "the server failed" in flushed[0].text
        for thread in threads:
            thread.join(timeout=HANG_GUARD_S)
        assert server.proc.wait(timeout=HANG_GUARD_S) != 0
        for stream in events:
            assert stream[-1] == "[DONE]" and "the server failed" in stream[-2]
        log = server.log_text()
        assert f"shutting down: {STREAMS} request(s) ended with an error ({STREAMS} when the " \
               f"server failed)" in log, log[-3000:]
    finally:
        server.stop()


def test_a_childs_failure_reaches_clients_as_one_line_with_its_exception() -> None:
    died = ("the scheduler process died (exit code 1):\nTraceback (most recent call last):\n"
            '  File "scheduler.py", line 1, in run_turn\n'
            "radixserve.mem.kv_pool.OutOfMemoryError: need 64 KV slots, 62 free\n")
    # clients used to get the first line alone, cut after "(exit code 1):"
    assert one_line_failure(died) == ("the scheduler process died (exit code 1): "
                                      "radixserve.mem.kv_pool.OutOfMemoryError: need 64 KV "
                                      "slots, 62 free")
    assert one_line_failure("the detokenizer process died (exit code -9)") == \
        "the detokenizer process died (exit code -9)"
