"""CPU kernels (cpu_ops.cpp), built with torch.utils.cpp_extension and loaded on first use.

`cpu_ops()` returns the compiled module, or None when it cannot be had (no C++ compiler or
ninja, a build error, RADIXSERVE_CPU_KERNELS=0): every caller then runs its plain PyTorch path,
so a machine without a toolchain serves as before, only slower. The build takes ~1 min on 2
cores; `scripts/setup.sh` runs it once (`python -m radixserve.core.cpu_kernels`), and the result
is cached under torch's extensions directory (TORCH_EXTENSIONS_DIR) for every later process.

The code is compiled for the vector unit of the machine that builds it (ATen's Vectorized:
AVX-512, else AVX2, else scalar), so the cached module's name carries a hash of the source and
of those flags: another CPU (a CI runner, a moved home directory) builds its own instead of
loading one that could use instructions it lacks.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType
from typing import Iterator

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_lock = threading.Lock()
_state: dict[str, object | None] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]  # -fopenmp: at::parallel_for uses OpenMP


def module_name(source: Path = _SOURCE) -> str:
    """The build's name: a hash of the source, the flags and the source's path. torch keys its
    build directory by name and rebuilds when the source path in its build file changes, so two
    checkouts sharing one name rebuilt each other's module at every alternation (~70 s each on
    2 cores); with the path in the name each checkout keeps its own build."""
    key = source.read_bytes() + str(source.resolve()).encode() + \
        " ".join(_CFLAGS + _capability_flags()).encode()
    digest = hashlib.sha1(key).hexdigest()[:12]
    return f"radixserve_cpu_ops_{digest}"


def _capability_flags() -> list[str]:
    """Compile for the widest vector unit of this CPU that ATen's Vectorized knows: AVX-512,
    else AVX2, else its portable scalar fallback."""
    flags = set(_cpu_flags().split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
    if {"avx2", "fma", "f16c"} <= flags:
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return ["-DCPU_CAPABILITY=DEFAULT"]


@contextlib.contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Held around torch's build of `name`: an OS lock (flock) on a file of the build folder,
    which the kernel releases when its holder dies. torch's builder waits without a timeout
    for its own `lock` file, which a build killed mid-way (a stopped server, a timed-out test)
    leaves behind, so every later process, servers included, hung at startup; while we hold
    ours, no live process of ours is building, so a `lock` file there is such a leftover and
    goes. Processes that come while one builds wait for it here."""
    from torch.utils.cpp_extension import _get_build_directory
    folder = Path(_get_build_directory(name, False))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "radixserve.flock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process's build of the CPU kernels")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            leftover = folder / "lock"
            if leftover.exists():
                logger.warning("removing %s, left by a CPU-kernel build that was killed",
                               leftover)
                leftover.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(verbose: bool = False) -> ModuleType:
    """Compile (or load the cached build of) the kernels; raises on failure."""
    from torch.utils.cpp_extension import load
    name = module_name()
    with _build_lock(name):
        return load(name=name, sources=[str(_SOURCE)], verbose=verbose,
                    extra_cflags=[*_CFLAGS, *_capability_flags()],
                    extra_ldflags=["-fopenmp"])


def cpu_ops() -> object | None:
    """The compiled kernels (the op namespace torch.ops.radixserve_cpu: decode_attention,
    rope_store, rms_norm, silu_and_mul, gemv), or None (logged once) when they are disabled or will
    not build."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            ops = None
            if os.environ.get("RADIXSERVE_CPU_KERNELS", "1") != "0":
                try:
                    build()
                    import torch
                    ops = torch.ops.radixserve_cpu
                except Exception as exc:  # noqa: BLE001 - any build failure means fall back
                    logger.warning("CPU kernels unavailable (%s: %s); using the PyTorch path",
                                   type(exc).__name__, str(exc).splitlines()[0] if str(exc)
                                   else "")
            _state["ops"] = ops
    return _state["ops"]


def pin_compute_threads() -> list[int] | None:
    """Pin torch's OpenMP threads one per core of this process's CPU set (thread i to the
    i-th core), so the compute threads stay on the cores the process owns and keep their
    caches. Skipped (None) without the kernels, on non-Linux, or with more threads than
    cores; returns the core of each thread."""
    import torch
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    ops = cpu_ops()
    if ops is None or torch.get_num_threads() > len(cores):
        return None
    pinned = list(ops.pin_threads(cores[:torch.get_num_threads()]))
    logger.info("compute threads pinned to cores %s", pinned)
    return pinned
