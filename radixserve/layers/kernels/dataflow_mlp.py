"""A decode batch's whole SwiGLU MLP, down(silu(gate(x)) * up(x)), in one launch (1-16 rows of
half-precision activations; GatedMLP runs it by default where MEASURED_SHAPES says).

At a few rows the three kernels of the MLP (gate|up, SiLU-mul, down) each stream their weights
at well under the HBM rate for their first and last microseconds: programs start, wait for the
previous kernel, fill their pipelines, and the last wave drains while most SMs idle. Here the
two products are one grid of work items, taken in order from a ticket counter:

- items 0 .. G-1 (gate|up tiles): BLOCK_H columns of the intermediate activation, the gate
  and up rows both streamed over all of K, then silu(gate) * up rounded as the unfused kernels
  round it, stored to a scratch buffer; the tile then counts itself into its K slice's counter
  (a release atomic);
- items G .. (down tiles): BLOCK_N output columns over one K slice of the intermediate
  activation. An item waits until every gate|up tile of its slice has counted in (an acquire
  spin), then streams its weight slice; the slices' partial sums are added by the last of a
  tile's programs to arrive, in slice order (deterministic), as the skinny GEMM does.

Tickets, not program ids, order the work, so a down item only ever waits on items that a
program already holds: no deadlock however the hardware schedules the grid, and down items
start while the last gate|up tiles still stream, which hides the boundary between the products.
In the Triton interpreter the programs run one after another in ticket order, so every wait is
already satisfied and the kernel is testable on the CPU. The counters are the per-device,
per-stream array the split-K kernels share (core/tile_counters.py: launches on one stream run
one after another, and each leaves it at zero); here the last down item to finish zeroes them.

What it gains is small: ~1% of the MLP's time at 12-16 rows (the three kernels already stream
at ~94% of the board's copy rate there), nothing at 8, a little less than nothing at 2. A form
on FP8 weights and activation codes lost 1-4.5% to the three FP8 kernels at 2-16 rows on the
same board and was removed (docs/PERFORMANCE.md, session 31).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.core.tile_counters import tile_counters
from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue

MAX_ROWS = 16  # one BLOCK_M tile of rows
MAX_SPLITS = 64  # K slices of the down product
MAX_DOWN_TILES = 4096  # output tiles of the down product
# the ticket, the finished down items, a counter per K slice, one per down tile (reduction)
SYNC_WORDS = 2 + MAX_SPLITS + MAX_DOWN_TILES


@dataclass(frozen=True)
class DataflowMlpConfig:
    block_h: int = 32  # intermediate columns per gate|up tile (2 * block_h weight rows)
    block_n: int = 64  # output columns per down tile
    block_k: int = 128  # K step of both products
    splits: int = 4  # K slices of the down product
    num_warps: int = 4
    num_stages: int = 4

    @classmethod
    def parse(cls, text: str) -> "DataflowMlpConfig":
        """'block_h,block_n,block_k,splits,num_warps,num_stages' (RADIXSERVE_DATAFLOW_MLP)."""
        values = [int(v) for v in text.split(",")]
        if len(values) != 6:
            raise ValueError(f"a dataflow MLP config has six integers, got {text!r}")
        return cls(*values)


# Where the one launch runs by default: the MLP shapes (hidden, intermediate on one rank) it was
# measured ahead of the three kernels at, with its configuration and the fewest rows it won at.
# Llama-3.1-8B, bf16, on an H100 (session 31): 123.7 against 125.3 us at 16 rows, 123.6
# against 124.0 at 12, whole decode steps 0.01-0.02 ms faster at 12 and 16 rows, level at 8,
# 0.03 ms slower at 2. Other shapes (70B's ranks, other models) keep the three kernels until
# measured (benchmarks/gpu_dataflow_mlp.py --hidden --inter, gpu_roofline.sh dataflow_ab).
MEASURED_SHAPES: dict[tuple[int, int], tuple[DataflowMlpConfig, int]] = {
    (4096, 14336): (DataflowMlpConfig(), 12),
}


def env_choice(hidden: int, inter: int) -> tuple[DataflowMlpConfig, int] | None:
    """(configuration, fewest rows it runs at) for an MLP of this shape, as
    RADIXSERVE_DATAFLOW_MLP asks: unset or '1' the MEASURED_SHAPES entry (None for a shape
    not measured), '0' never (the three-kernel MLP), six integers that configuration at 1-16
    rows (A/B runs and sweeps, any shape)."""
    text = os.environ.get("RADIXSERVE_DATAFLOW_MLP", "1")
    if text == "0":
        return None
    if text in ("", "1"):
        return MEASURED_SHAPES.get((hidden, inter))
    return DataflowMlpConfig.parse(text), 1


@triton.jit
def _gate_up_tile(X, WGU, Hbuf, Sync, tile, M, HID, INTER, k_per_split, stride_x, stride_w,
                  BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_h = tile * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    h_mask = offs_h < INTER
    m_mask = offs_m < M
    x_ptrs = X + offs_m[None, :].to(tl.int64) * stride_x + offs_k[:, None]
    wg_ptrs = WGU + offs_h[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    wu_ptrs = wg_ptrs + INTER.to(tl.int64) * stride_w
    acc_g = tl.zeros([BLOCK_H, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_H, BLOCK_M], dtype=tl.float32)
    for k_start in range(0, HID, BLOCK_K):
        k_mask = offs_k < HID - k_start
        x = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        wg = tl.load(wg_ptrs, mask=h_mask[:, None] & k_mask[None, :], other=0.0,
                     eviction_policy="evict_first")
        wu = tl.load(wu_ptrs, mask=h_mask[:, None] & k_mask[None, :], other=0.0,
                     eviction_policy="evict_first")
        acc_g = tl.dot(wg, x, acc_g)
        acc_u = tl.dot(wu, x, acc_u)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    dtype = Hbuf.dtype.element_ty
    # rounded as gate|up's output, then SiLU-mul (kernels/silu_and_mul.py), would round it
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h_ptrs = Hbuf + offs_m[None, :].to(tl.int64) * INTER + offs_h[:, None]
    tl.store(h_ptrs, (silu * up).to(dtype), mask=h_mask[:, None] & m_mask[None, :])
    tl.debug_barrier()  # every thread's store is issued before the release below
    tl.atomic_add(Sync + 2 + (tile * BLOCK_H) // k_per_split, 1, sem="release")


@triton.jit
def _down_tile(Hbuf, WD, Y, Work, Sync, item, n_tiles, splits, M, HID, INTER, k_per_split,
               stride_wd, stride_y, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAX_SPLITS: tl.constexpr):
    split = item // n_tiles
    tile_n = item % n_tiles
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, INTER)
    need = tl.cdiv(k_end - k_begin, BLOCK_H)  # gate|up tiles in this K slice
    slice_count = Sync + 2 + split
    arrived = tl.load(slice_count, volatile=True)
    while arrived < need:
        arrived = tl.load(slice_count, volatile=True)
    tl.atomic_add(slice_count, 0, sem="acquire")  # orders the loads of the slice below

    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < HID
    m_mask = offs_m < M
    h_ptrs = Hbuf + offs_m[None, :].to(tl.int64) * INTER + k_begin + offs_k[:, None]
    w_ptrs = WD + offs_n[:, None].to(tl.int64) * stride_wd + k_begin + offs_k[None, :]
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k_start
        h = tl.load(h_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0,
                    cache_modifier=".cg")
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc_t = tl.dot(w, h, acc_t)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    # the slices' partials, added by the tile's last program to arrive (in slice order)
    offs_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tile_ptrs = Work + tile_n.to(tl.int64) * (BLOCK_N * BLOCK_M) + offs_tile
    split_elems = n_tiles.to(tl.int64) * (BLOCK_N * BLOCK_M)
    tl.store(tile_ptrs + split * split_elems, acc_t)
    tl.debug_barrier()
    reduce_count = Sync + 2 + MAX_SPLITS + tile_n
    if tl.atomic_add(reduce_count, 1, sem="acq_rel") == splits - 1:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for s in range(0, splits):
            acc_t += tl.load(tile_ptrs + s * split_elems, cache_modifier=".cg")
        tl.atomic_xchg(reduce_count, 0)
        y_ptrs = Y + offs_m[None, :].to(tl.int64) * stride_y + offs_n[:, None]
        tl.store(y_ptrs, acc_t.to(Y.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


# counts that can be 1 stay runtime integers (Triton would make a 1 a compile-time constant,
# without the tensor methods the kernel calls on them, and compile once more for it)
@triton.jit(do_not_specialize=["gate_up_tiles", "n_tiles", "splits"])
def _dataflow_mlp_kernel(X, WGU, WD, Y, Hbuf, Work, Sync, M, HID, INTER, k_per_split,
                         gate_up_tiles, n_tiles, splits, stride_x, stride_wgu, stride_wd,
                         stride_y, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         MAX_SPLITS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    ticket = tl.atomic_add(Sync, 1, sem="relaxed")
    if ticket < gate_up_tiles:
        _gate_up_tile(X, WGU, Hbuf, Sync, ticket, M, HID, INTER, k_per_split, stride_x,
                      stride_wgu, BLOCK_M, BLOCK_H, BLOCK_K)
    else:
        _down_tile(Hbuf, WD, Y, Work, Sync, ticket - gate_up_tiles, n_tiles, splits, M, HID,
                   INTER, k_per_split, stride_wd, stride_y, BLOCK_M, BLOCK_H, BLOCK_N, BLOCK_K,
                   MAX_SPLITS)
        down_items = n_tiles * splits
        if tl.atomic_add(Sync + 1, 1, sem="acq_rel") == down_items - 1:
            # every ticket is taken and every slice counted: zero the counters for next time
            offs = tl.arange(0, MAX_SPLITS)
            tl.store(Sync + 2 + offs, tl.zeros([MAX_SPLITS], dtype=tl.int32))
            tl.atomic_xchg(Sync + 1, 0)
            tl.atomic_xchg(Sync, 0)


def supports(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
             cfg: DataflowMlpConfig) -> bool:
    """Whether `dataflow_mlp` takes these operands: 1-16 rows of half-precision (or float32)
    activations with contiguous columns, weights of their dtype with contiguous rows (gate|up
    [2I, H], down [H, I]) and a K slicing the counters cover."""
    rows = x.shape[0] if x.dim() == 2 else 0
    inter = down.shape[1]
    dtypes_fit = x.dtype in (torch.float16, torch.bfloat16, torch.float32) and \
        gate_up.dtype == down.dtype == x.dtype
    if not (1 <= rows <= MAX_ROWS and dtypes_fit and x.stride(-1) == 1
            and gate_up.stride(1) == 1 and down.stride(1) == 1):
        return False
    if gate_up.shape != (2 * inter, x.shape[1]) or down.shape[0] != x.shape[1]:
        return False
    k_per_split = _k_per_split(inter, cfg)
    return triton.cdiv(inter, k_per_split) <= MAX_SPLITS and \
        triton.cdiv(down.shape[0], cfg.block_n) <= MAX_DOWN_TILES


def _k_per_split(inter: int, cfg: DataflowMlpConfig) -> int:
    """Columns of the intermediate activation per down slice: whole gate|up tiles and K steps."""
    step = math.lcm(cfg.block_h, cfg.block_k)
    return triton.cdiv(triton.cdiv(inter, cfg.splits), step) * step


def dataflow_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 cfg: DataflowMlpConfig) -> torch.Tensor:
    """down @ (silu(x @ gate.T) * (x @ up.T)) for x [M, H] (M <= 16), gate_up [2I, H] (gate
    rows, then up rows), down [H, I] -> [M, H] in x's dtype; the caller has checked
    `supports` (GatedMLP does)."""
    rows, hidden = x.shape
    inter = down.shape[1]
    k_per_split = _k_per_split(inter, cfg)
    splits = triton.cdiv(inter, k_per_split)
    n_tiles = triton.cdiv(hidden, cfg.block_n)
    gate_up_tiles = triton.cdiv(inter, cfg.block_h)
    y = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    work = torch.empty(splits * n_tiles * cfg.block_n * MAX_ROWS, dtype=torch.float32,
                       device=x.device)
    grid = (gate_up_tiles + n_tiles * splits,)
    _dataflow_mlp_kernel[grid](
        x, gate_up, down, y, h, work, tile_counters(x.device, SYNC_WORDS), rows, hidden, inter,
        k_per_split, gate_up_tiles, n_tiles, splits,
        x.stride(0), gate_up.stride(0), down.stride(0), y.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        MAX_SPLITS=MAX_SPLITS, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch_args(h))
    return y
