"""CPU serving: the scheduler's compute threads own the cores; the other processes yield.

On a CPU device the model runs on torch's OpenMP threads, one per core; every parallel region
waits for its slowest thread, so a helper process that wakes on a compute thread's core (the
HTTP server streaming a chunk, the detokenizer decoding one) stalls the whole step, not just
that thread. So on CPU:

  * the scheduler pins its OpenMP threads one per core of its CPU set
    (`core.cpu_kernels.pin_compute_threads`), so they neither migrate nor lose their caches
    (RADIXSERVE_CPU_PIN=0 turns it off);
  * oneDNN's primitive cache and ideep's weight-format cache, which torch's CPU matmuls fill
    with one entry per distinct row count (each prefill batch of a new size: 2-40 MB an entry
    on SmolLM2-135M, 1,024 entries by default), are bounded to MATMUL_CACHE_ENTRIES entries
    each (`bound_matmul_caches`; the environment's ONEDNN_PRIMITIVE_CACHE_CAPACITY and
    LRU_CACHE_CAPACITY win). A probe's scheduler grew 0.9 GB in 10 minutes of mixed traffic,
    still rising; 200 prompts of distinct lengths added 663 MB, then 226 MB more (64 entries:
    294, then 41, at the same speed);
  * the HTTP process (after its children started, which keep the default priority) and the
    detokenizer can lower their priority by `RADIXSERVE_CPU_HELPER_NICE` (default 0: off):
    their wake-ups then do not preempt a running compute thread and they run in the gaps. It
    is off by default: on 2 cores it gained nothing measurable on HTTP streaming throughput,
    and a starved HTTP process notices client disconnects late (200 streams with 67 hang-ups
    finished their 48 tokens before the aborts arrived: tests/server/test_load_e2e.py).
"""
from __future__ import annotations

import logging
import os

from radixserve.config import ServerArgs

logger = logging.getLogger(__name__)


def _on_cpu(server_args: ServerArgs) -> bool:
    return server_args.resolve().device.startswith("cpu")


# entries of each CPU matmul cache (see the module docstring); 0 would disable them, and
# crashed a standalone test: never below 1
MATMUL_CACHE_ENTRIES = 256


def bound_matmul_caches(server_args: ServerArgs) -> None:
    """On a CPU device, bound torch's CPU matmul caches for the children this process is
    about to spawn (they read the environment when torch loads), unless the environment
    sets them."""
    if not _on_cpu(server_args):
        return
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(MATMUL_CACHE_ENTRIES))


def yield_to_compute(server_args: ServerArgs, who: str) -> None:
    """Lower this (helper) process's priority on a CPU device."""
    nice = int(os.environ.get("RADIXSERVE_CPU_HELPER_NICE", "0"))
    if nice <= 0 or not _on_cpu(server_args) or not hasattr(os, "nice"):
        return
    try:
        os.nice(nice)
    except OSError as exc:  # not allowed here: serving works, a little slower
        logger.debug("could not lower the %s process's priority: %s", who, exc)


def pin_scheduler_threads(server_args: ServerArgs) -> None:
    """Pin the scheduler's compute threads (one rank on CPU), when the CPU kernels built."""
    if server_args.tp_size > 1 or server_args.dp_size > 1 or not _on_cpu(server_args) or \
            os.environ.get("RADIXSERVE_CPU_PIN", "1") == "0":
        return
    from radixserve.core.cpu_kernels import pin_compute_threads
    pin_compute_threads()
