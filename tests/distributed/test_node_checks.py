"""Multi-node flags checked before any rank starts: --nnodes below 1 is refused as such, and a
headless node (--node-rank > 0) refuses a model split it cannot make with node 0's one error
line instead of a traceback from each of its ranks."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from radixserve.config import ServerArgs
from tests.server.server_process import REPO_ROOT, free_port

HANG_GUARD_S = 240


@pytest.mark.parametrize("nnodes", [0, -1])
def test_nnodes_below_one_is_refused_as_such(nnodes: int) -> None:
    with pytest.raises(ValueError, match=f"--nnodes must be >= 1, got {nnodes}"):
        ServerArgs(nnodes=nnodes, device="cpu").resolve()


@pytest.mark.slow  # 9 s
def test_headless_node_refuses_a_split_the_model_cannot_make() -> None:
    """The bundled model has 9 attention heads: --tp-size 2 cannot split them, on any node."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "radixserve.launch_server", "--tp-size", "2", "--nnodes", "2",
         "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{free_port()}", "--device", "cpu"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "cannot serve the model: --tp-size 2 does not divide the model's 9 attention " \
           "heads" in output
    assert "Traceback" not in output
    assert "following node 0" not in output  # no rank started


@pytest.mark.parametrize("address", ["10.0.0.1", "host:port", "::1:29500", ":29500",
                                     "h:70000"])
def test_a_dist_init_addr_that_is_not_host_port_is_refused(address: str) -> None:
    with pytest.raises(ValueError, match="is not host:port"):
        ServerArgs(device="cpu", tp_size=2, dist_init_addr=address).resolve()
    ServerArgs(device="cpu", tp_size=2, dist_init_addr="[::1]:29500").resolve()


def test_the_ranks_meet_at_the_host_and_port_the_flag_names() -> None:
    """One parser for the check and the rendezvous: an IPv6 host loses its brackets."""
    from radixserve.config import split_host_port
    assert split_host_port("[::1]:29500") == ("::1", 29500)
    assert split_host_port("node0.cluster:1234") == ("node0.cluster", 1234)
