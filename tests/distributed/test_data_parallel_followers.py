"""--dp-size 2 --tp-size 2: /get_server_info lists every replica's tensor-parallel followers
(not only replica 0's), flat in replica order and per replica, and the pid listed for replica
1 is its follower: killing it takes the server down, named as dp1-tp1."""
from __future__ import annotations

import os
import signal

import pytest

from tests.models.tiny_checkpoints import make_checkpoint
from tests.server.server_process import ServerProcess, pid_alive, wait_gone

HANG_GUARD_S = 60


@pytest.mark.slow  # 16 s: four model processes on CI's two cores; a follower's death
# taking the server down is test_turn_watchdog.py's (tp 2), in CI
def test_server_info_lists_every_replicas_followers(tmp_path) -> None:
    make_checkpoint("llama_gqa_llama3_rope", tmp_path)  # 4 heads, 2 KV heads
    server = ServerProcess("--model-path", str(tmp_path), "--dp-size", "2", "--tp-size", "2",
                           "--dtype", "float32", "--skip-tokenizer-init",
                           "--max-total-tokens", "1024")
    try:
        info = server.server_info()
        per_replica = info["tp_follower_pids_per_replica"]
        assert len(per_replica) == 2 and all(len(pids) == 1 for pids in per_replica)
        assert info["tp_follower_pids"] == per_replica[0] + per_replica[1]
        followers = info["tp_follower_pids"]
        schedulers = info["scheduler_pids"]
        assert len(schedulers) == 2 and info["scheduler_pid"] == schedulers[0]
        assert len(set(followers + schedulers)) == 4 and all(map(pid_alive, followers))

        os.kill(per_replica[1][0], signal.SIGKILL)
        assert server.proc.wait(timeout=HANG_GUARD_S) != 0
        assert "the dp1-tp1 process died" in server.log_text()
        assert all(wait_gone(pid) for pid in followers + schedulers)
    finally:
        server.stop()
