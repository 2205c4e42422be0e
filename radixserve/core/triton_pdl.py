"""Programmatic dependent launch (PDL) for our Triton kernels on Hopper and later.

A decode step at batch 1 is ~450 short kernels in a row; between two of them the GPU idles while
the next one is launched and its programs are set up. With PDL a kernel is launched while its
predecessor is still running: its programs start, call `gdc_wait` (which returns once the
predecessor has finished and its writes are visible) and only then touch memory. So every kernel
here that takes `USE_PDL` calls `pdl_prologue()` before its first load or store, which keeps
each kernel exactly as ordered as without PDL: only launch latency overlaps. They also let their
own successor launch early (`gdc_launch_dependents`) right away.

`pdl_launch_args(t)` gives the kernel arguments for a launch on t's device: PDL on CUDA devices of
compute capability >= 9 with a Triton that has the intrinsics, unless RADIXSERVE_PDL=0.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_launch_then_wait(USE_PDL: tl.constexpr):
    """`pdl_prologue` in the other order: the next kernel may launch before this one's own
    predecessor has finished. For a kernel whose successor does useful work before its wait
    (the one-row GEMV loads its first weight tile, and no kernel writes weights): at batch 1
    the decode-attention merge launches o_proj this way, so that load overlaps the split
    kernel. Still ordered: a kernel's wait returns only once its predecessor has finished, and
    that one finished only after its own wait."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@functools.lru_cache(maxsize=None)
def _pdl_supported(device_index: int) -> bool:
    if os.environ.get("RADIXSERVE_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    cuda_extra = getattr(getattr(tl, "extra", None), "cuda", None)
    return hasattr(cuda_extra, "gdc_wait") and hasattr(cuda_extra, "gdc_launch_dependents")


def disable_pdl() -> None:
    """Launch without PDL from now on (kernels compiled with it stay cached but unused)."""
    os.environ["RADIXSERVE_PDL"] = "0"
    _pdl_supported.cache_clear()


def pdl_launch_args(t: torch.Tensor) -> dict[str, Any]:
    """{"USE_PDL": ..., "launch_pdl": ...} for a kernel launched on t's device."""
    if t.is_cuda and _pdl_supported(t.device.index if t.device.index is not None
                                    else torch.cuda.current_device()):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
