"""Weights brought into L2 ahead of their product, while latency-bound kernels hold the GPU.

A small decode batch reads its weights once per step at HBM bandwidth, but between the products
run kernels that read almost nothing and are bound by latency: at batch 1 on an H200 the
decode attention and its merge take ~9 us per layer for ~4 MB of K/V, during which HBM idles.
Hopper's bulk L2 prefetch (`cp.async.bulk.prefetch.L2.global`, a hint with no completion to
wait for) over a prefix of a weight lets the next product read that prefix from L2, the bytes
having been fetched under the latency-bound kernels.

`prefetch_chunks` issues it, one chunk per lane (the last one shorter, a multiple of 16: the
instruction's unit); the decode attention kernel calls it from its programs, which costs no
launch. `prefetch_to_l2` launches a kernel of its own instead (one warp per LANES chunks). That
kernel takes part in the PDL chain like every other kernel here (triton_pdl.py): it lets its
successor launch at once and finishes only after its predecessor did, so it never reorders the
step. BEFORE_WAIT issues the prefetches before that wait (they then overlap the predecessor's
own reads), otherwise after.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from radixserve.core.triton_pdl import pdl_launch_args

LANES = 32
# the instruction prefetches a multiple of 16 bytes from a 16-byte aligned address
PREFETCH_ALIGN = 16

_PREFETCH_ASM = tl.constexpr("""{
.reg .pred p;
setp.ne.u32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")


@triton.jit
def prefetch_chunks(addr0, bytes0, addr1, bytes1, chunk, first_chunk,
                    LANES_PER_PROGRAM: tl.constexpr):
    """Prefetch chunks first_chunk.. first_chunk + LANES_PER_PROGRAM - 1 of the bytes
    [addr0, addr0 + bytes0) followed by [addr1, addr1 + bytes1), one chunk per lane; the chunk
    that straddles the two stops at the first one's end. Chunks past the end do nothing."""
    offsets = (first_chunk + tl.arange(0, LANES_PER_PROGRAM)).to(tl.int64) * chunk
    in_first = offsets < bytes0
    offsets1 = offsets - bytes0
    addrs = tl.where(in_first, addr0 + offsets, addr1 + offsets1)
    left = tl.where(in_first, bytes0 - offsets, bytes1 - offsets1)
    sizes = tl.minimum(tl.maximum(left, 0), chunk).to(tl.int32)
    tl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [addrs, sizes], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(base_addr, nbytes, chunk, LANES_PER_PROGRAM: tl.constexpr,
                        BEFORE_WAIT: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if not BEFORE_WAIT:
            tl.extra.cuda.gdc_wait()
    prefetch_chunks(base_addr, nbytes, base_addr, 0, chunk,
                    tl.program_id(0) * LANES_PER_PROGRAM, LANES_PER_PROGRAM)
    if USE_PDL:
        if BEFORE_WAIT:
            tl.extra.cuda.gdc_wait()


def chunk_for(total_bytes: int, programs: int) -> int:
    """Bytes per lane so that `programs` programs of LANES lanes cover total_bytes."""
    per_lane = triton.cdiv(total_bytes, programs * LANES)
    return max(triton.cdiv(per_lane, PREFETCH_ALIGN) * PREFETCH_ALIGN, PREFETCH_ALIGN)


@functools.lru_cache(maxsize=None)
def _has_bulk_prefetch(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def prefetch_supported(t: torch.Tensor) -> bool:
    """Bulk L2 prefetch exists from sm_90 (Hopper) on; not in the interpreter."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _has_bulk_prefetch(index)


def prefetch_bytes(t: torch.Tensor, fraction: float) -> int:
    """The prefix of t's storage that `fraction` of it names, rounded down to the unit."""
    total = t.numel() * t.element_size()
    return int(total * min(max(fraction, 0.0), 1.0)) // PREFETCH_ALIGN * PREFETCH_ALIGN


def prefetch_to_l2(t: torch.Tensor, nbytes: int, chunk: int = 1 << 16,
                   before_wait: bool = False) -> None:
    """Ask L2 for the first nbytes of contiguous t (a weight: nothing may write it meanwhile).
    No host sync, no allocation: safe to capture in a CUDA graph."""
    assert t.is_contiguous() and t.data_ptr() % PREFETCH_ALIGN == 0
    assert chunk % PREFETCH_ALIGN == 0 and nbytes % PREFETCH_ALIGN == 0
    nbytes = min(nbytes, t.numel() * t.element_size())
    if nbytes <= 0:
        return
    programs = triton.cdiv(triton.cdiv(nbytes, chunk), LANES)
    _l2_prefetch_kernel[(programs,)](
        t.data_ptr(), nbytes, chunk, LANES_PER_PROGRAM=LANES, BEFORE_WAIT=before_wait,
        num_warps=1, num_stages=1, **pdl_launch_args(t))
