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


def test_the_cpu_matmul_caches_are_bounded_for_the_children(monkeypatch) -> None:
    """A CPU server bounds oneDNN's and ideep's per-shape caches for the processes it spawns
    (each distinct prefill size added megabytes, 1,024 entries by default); the environment's
    own values win; a GPU server leaves them alone."""
    from radixserve.server import cpu_priority

    names = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    for name in names:  # set, then deleted: the test's end restores the real environment
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    monkeypatch.setattr(cpu_priority, "_on_cpu", lambda args: False)
    cpu_priority.bound_matmul_caches(ServerArgs(device="cuda"))
    assert not any(name in os.environ for name in names)
    monkeypatch.setattr(cpu_priority, "_on_cpu", lambda args: True)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "32")
    cpu_priority.bound_matmul_caches(ServerArgs(device="cpu"))
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == \
        str(cpu_priority.MATMUL_CACHE_ENTRIES)
    assert os.environ["LRU_CACHE_CAPACITY"] == "32"
