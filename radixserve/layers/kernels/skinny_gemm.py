"""x [M, K] @ W.T for decode-sized M (2-64 rows), W bf16/fp16 or FP8 codes with scales, in Triton.

Decode batches of a few rows are bound by reading the weights, not by the tensor cores, and
cuBLAS picks tiles made for large M at these sizes. Each program here owns a BLOCK_M x BLOCK_N
output tile (BLOCK_M 16 or 32, the smallest the tensor cores take) and optionally a K range
(grid dimension 2: SPLIT_K programs per tile add their partial products into a float32 output
with atomics), so small N still puts every SM to work. SWAP_AB computes the tile transposed
(weight rows as the MMA's first operand, in their memory order), which spares the weight tile
a layout change before the MMA.

FP8 weights (HAS_SCALE) are loaded as codes (half the bytes of bf16), converted in registers
(every FP8 value is exact in bf16) and multiplied on the bf16 tensor cores; scales apply per
output row once at the end, or (GROUPED) per K group of GROUP_K columns: each BLOCK_K step lies
in one group, so its partial product is scaled before it is added.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixserve.core.tile_counters import tile_counters
from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue

TARGET_PROGRAMS = 264  # ~2 per SM on an H200 (132 SMs)
# A vendor kernel (cuBLAS, _scaled_mm) does not take part in programmatic dependent launch: the
# kernel after it launches only once it has finished, which an isolated sweep does not see.
# H200, Llama-3.1-8B, decode at batch 8 (session 25): q|k|v on the swept tile, 0.5 us faster
# than cuBLAS alone, took the step from 5.15 to 5.02-5.04 ms; gate|up and down on tiles too,
# which cuBLAS beat alone by ~2 and ~1.3 us, to 4.95. So a tile within VENDOR_GAP_US of the
# vendor kernel runs where an entry keeps one ("triton", gpu_gemm_tune.py);
# RADIXSERVE_VENDOR_GAP_US=0 keeps the isolated sweep's pick (A/B: gpu_roofline.sh vendor_gap).
VENDOR_GAP_US = float(os.environ.get("RADIXSERVE_VENDOR_GAP_US", "3"))
# Split K summed by the last program of each tile to arrive (one kernel, launched with PDL,
# the splits added in a fixed order) instead of float32 atomics into a zeroed buffer and a cast
# back (two more launches that take no part in PDL). H200, Llama-3.1-8B decode with session 25's
# tiles (down's K split in 4), one board, twice each (session 26): batch 4 4.84 -> 4.77, batch 8
# 4.90 -> 4.82, batch 16 5.20 -> 5.09 ms. RADIXSERVE_SKINNY_SPLIT_REDUCE=atomic for the old way.
SPLIT_LAST_REDUCES = os.environ.get("RADIXSERVE_SKINNY_SPLIT_REDUCE", "last") != "atomic"
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "SWAP_AB", "num_warps",
               "num_stages")


@triton.jit
def _skinny_gemm_kernel(X, W, Scale, B, Y, Work, Counters, M, N, K, k_per_split, stride_xm,
                        stride_wn, stride_sn, stride_ym, HAS_SCALE: tl.constexpr,
                        GROUPED: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        ATOMIC: tl.constexpr, LAST_REDUCES: tl.constexpr,
                        SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Split K (grid dimension 2): program_id(2) takes K columns [s * k_per_split, (s + 1) *
    k_per_split). ATOMIC: it adds its partial product into the float32 Y (bias added by the
    caller). LAST_REDUCES: it leaves the partial in Work, and the last of the tile's programs
    to arrive (Counters, core/tile_counters.py) adds the partials in split order and writes Y
    in its dtype, bias included. SWAP_AB computes the transposed tile W_tile @ x_tile.T: the
    weight rows are the MMA's first operand, loaded as they lie in memory (K contiguous), and
    the few x rows its second."""
    pdl_prologue(USE_PDL)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    k_begin = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if SWAP_AB:
        x_ptrs = X + offs_m[None, :].to(tl.int64) * stride_xm + k_begin + offs_k[:, None]
        w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + k_begin + offs_k[None, :]
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + k_begin + offs_k[None, :]
        w_ptrs = W + offs_n[None, :].to(tl.int64) * stride_wn + k_begin + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k_start
        if HAS_SCALE and GROUPED:
            s = tl.load(Scale + offs_n * stride_sn + k_start // GROUP_K, mask=n_mask, other=0.0)
        if SWAP_AB:
            x = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
            part_t = tl.dot(w.to(x.dtype), x)
            if HAS_SCALE and GROUPED:
                part_t = part_t * s[:, None]
            acc_t += part_t
        else:
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0,
                        eviction_policy="evict_first")
            part = tl.dot(x, w.to(x.dtype))
            if HAS_SCALE and GROUPED:
                part = part * s[None, :]
            acc += part
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc_t)
    if HAS_SCALE and not GROUPED:
        acc = acc * tl.load(Scale + offs_n * stride_sn, mask=n_mask, other=0.0)[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])
    elif LAST_REDUCES:
        tiles = tl.num_programs(0) * tl.num_programs(1)
        tile = pid_m * tl.num_programs(0) + pid_n
        offs_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_ptrs = Work + tile.to(tl.int64) * (BLOCK_M * BLOCK_N) + offs_tile
        split_elems = tiles.to(tl.int64) * (BLOCK_M * BLOCK_N)  # one split's partials
        tl.store(tile_ptrs + tl.program_id(2) * split_elems, acc)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(Counters + tile, 1, sem="acq_rel")
        if arrived == tl.num_programs(2) - 1:  # the last of the tile's programs: sum, write
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in range(0, tl.num_programs(2)):
                acc += tl.load(tile_ptrs + split * split_elems, cache_modifier=".cg")
            tl.atomic_xchg(Counters + tile, 0)  # ready for the next launch
            if HAS_BIAS:
                acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, acc.to(Y.dtype.element_ty),
                     mask=m_mask[:, None] & n_mask[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def config_from_entry(entry: dict | None,
                      vendor_gap_us: float | None = None) -> dict[str, int] | None:
    """The launch configuration of a swept table entry; None where the vendor kernel runs: a
    vendor-kernel entry, unless it keeps the best Triton tile ("triton") and that tile was at
    most vendor_gap_us slower (default VENDOR_GAP_US)."""
    if not entry:
        return None
    if "BLOCK_N" in entry:
        return {key: int(entry.get(key, 0)) for key in CONFIG_KEYS}
    gap = VENDOR_GAP_US if vendor_gap_us is None else vendor_gap_us
    tile = entry.get("triton")
    if tile and gap > 0 and entry.get("triton_us", float("inf")) <= entry["us"] + gap:
        return {key: int(tile.get(key, 0)) for key in CONFIG_KEYS}
    return None


def default_config(m: int, n: int, k: int, group_k: int | None) -> dict[str, int]:
    """Without a swept entry: 16/32-row tiles for decode sizes with K split until there are
    about TARGET_PROGRAMS programs; 64 and 128-row tiles above."""
    if m <= 32:
        cfg = dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=64, BLOCK_K=128, num_warps=4,
                   num_stages=4, SPLIT_K=1)
    elif m <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, SPLIT_K=1)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, SPLIT_K=1)
    if group_k is not None:  # a K step must not straddle two scale groups
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], group_k)
    if m <= 32:
        tiles = triton.cdiv(n, cfg["BLOCK_N"]) * triton.cdiv(m, cfg["BLOCK_M"])
        split = 1
        while tiles * split * 2 <= TARGET_PROGRAMS and k // (split * 2) >= 4 * cfg["BLOCK_K"]:
            split *= 2
        cfg["SPLIT_K"] = split
    return cfg


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, cfg: dict[str, int],
                scale: torch.Tensor | None = None, group_k: int | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in x's dtype; weight [N, K] in x's dtype, or
    FP8 codes with scale [N, G] (G > 1: group_k columns per scale group)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    has_scale = scale is not None
    grouped = has_scale and scale.shape[1] > 1
    block_k = cfg["BLOCK_K"]
    if grouped and group_k:
        block_k = min(block_k, group_k)
    split = cfg["SPLIT_K"]
    atomic = split > 1 and not SPLIT_LAST_REDUCES
    # atomic split K: float32 partial sums added with atomics, so the buffer starts at zero
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    work = counters = y
    if split > 1 and not atomic:
        tiles = grid[0] * grid[1]
        work = torch.empty(split * tiles * cfg["BLOCK_M"] * cfg["BLOCK_N"],
                           dtype=torch.float32, device=x.device)
        counters = tile_counters(x.device, tiles)
    if m:
        k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
        _skinny_gemm_kernel[grid](
            x2, weight, scale if has_scale else weight, bias if bias is not None else weight,
            y, work, counters, m, n, k, k_per_split, x2.stride(0), weight.stride(0),
            scale.stride(0) if has_scale else 0, y.stride(0), HAS_SCALE=has_scale,
            GROUPED=grouped, GROUP_K=group_k or k, HAS_BIAS=bias is not None,
            ATOMIC=atomic, LAST_REDUCES=split > 1 and not atomic,
            SWAP_AB=bool(cfg.get("SWAP_AB", 0)), BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch_args(x2))
    if atomic:
        y = (y + bias.float()).to(x.dtype) if bias is not None else y.to(x.dtype)
    return y.view(*x.shape[:-1], n)
