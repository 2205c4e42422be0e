"""CPU serving: compute threads pinned one per core, helper processes at a lower priority."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from radixserve.config import ServerArgs
from radixserve.core.cpu_kernels import cpu_ops
from radixserve.server.cpu_priority import yield_to_compute


@pytest.mark.skipif(cpu_ops() is None or not hasattr(os, "sched_getaffinity"),
                    reason="needs the CPU kernels and Linux affinity")
def test_pin_compute_threads_puts_each_thread_on_its_own_core() -> None:
    # in a child: pinning changes the calling process's threads for good
    code = ("import os, torch\n"
            "from radixserve.core.cpu_kernels import pin_compute_threads\n"
            "cores = sorted(os.sched_getaffinity(0))\n"
            "torch.set_num_threads(len(cores))\n"
            "pinned = pin_compute_threads()\n"
            "assert pinned == cores, (pinned, cores)\n"
            "assert os.sched_getaffinity(0) == {cores[0]}  # the main thread is thread 0\n"
            "x = torch.randn(256, 256)\n"
            "assert torch.allclose(x @ x, (x.double() @ x.double()).float(), atol=1e-3)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_helpers_yield_on_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "nice", lambda n: calls.append(n) or n)
    yield_to_compute(ServerArgs(device="cpu"), "test")
    assert calls == []  # off by default (see cpu_priority.py)
    monkeypatch.setenv("RADIXSERVE_CPU_HELPER_NICE", "10")
    yield_to_compute(ServerArgs(device="cpu"), "test")
    assert calls == [10]
