"""A scheduler turn that hangs takes the server down (--watchdog-timeout): the watchdog fires
once for a turn past its limit, never for turns that end in time or while idle; with a
tensor-parallel rank stopped (SIGSTOP), the server ends the request in flight with an error and
exits, instead of leaving it waiting with /health at 200."""
from __future__ import annotations

import os
import signal
import threading
import time

import requests

from radixserve.server import turn_watchdog
from radixserve.server.turn_watchdog import TurnWatchdog
from tests.models.tiny_checkpoints import make_checkpoint
from tests.server.server_process import ServerProcess


def test_the_watchdog_fires_once_for_a_turn_past_its_limit(monkeypatch) -> None:
    monkeypatch.setattr(turn_watchdog, "CHECK_EVERY_S", 0.02)
    hangs: list[float] = []
    fired = threading.Event()
    watchdog = TurnWatchdog(0.2, on_hang=lambda s: (hangs.append(s), fired.set()))
    for _ in range(5):  # short turns, and idle time between them: nothing
        watchdog.turn_started()
        time.sleep(0.05)
        watchdog.turn_ended()
        time.sleep(0.3)
    assert hangs == []
    watchdog.turn_started()  # this one never ends
    assert fired.wait(timeout=10)
    time.sleep(0.3)
    assert len(hangs) == 1 and hangs[0] > 0.2


def test_a_stopped_rank_takes_the_server_down_with_an_error(tmp_path) -> None:
    make_checkpoint("qwen3_qk_norm", tmp_path)
    server = ServerProcess("--model-path", str(tmp_path), "--tp-size", "2", "--dtype",
                           "float32", "--skip-tokenizer-init", "--max-total-tokens", "1024",
                           "--watchdog-timeout", "5", "--shutdown-timeout", "1")
    follower = None
    try:
        body = {"input_ids": list(range(1, 30)),
                "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        assert requests.post(server.url("/generate"), json=body, timeout=120).status_code == 200
        follower = server.server_info()["tp_follower_pids"][0]
        os.kill(follower, signal.SIGSTOP)
        answer = requests.post(server.url("/generate"), json=body, timeout=120)
        assert answer.status_code >= 500 and "the server failed" in answer.text, answer.text
        server.proc.wait(timeout=60)
        assert server.proc.returncode == 1
        assert "past --watchdog-timeout" in server.log_text()
    finally:
        if follower is not None:
            try:
                os.kill(follower, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()
