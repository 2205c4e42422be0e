"""moe_align_block_size in one Triton launch (decode-sized inputs).

One program: counts per expert (tl.histogram over chunks of pairs), each expert's run padded to
BLOCK_M (tl.cumsum gives the run starts), the sentinel fill and the expert of every block up to
the padded total (past it the GEMMs read nothing, and nothing is written there), then
each pair scattered to run start + its rank among the chunk's and the earlier chunks' pairs of
the same expert (a cursor per expert kept in a small scratch buffer). Pairs of one expert keep
their order. The torch version (fused_moe.moe_align_block_size) launches ~12 kernels; a decode
step runs this once per MoE layer, so the launches were most of its cost at small batches. One
program walks all pairs, so this is for small pair counts only (ALIGN_KERNEL_MAX_PAIRS).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ALIGN_KERNEL_MAX_PAIRS = 4096


@triton.jit
def _moe_align_kernel(Topk_ids, Sorted_ids, Expert_ids, Total, Cursor,
                      num_pairs, num_experts,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_FILL: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    offs_p = tl.arange(0, BLOCK_P)
    # 1. pairs per expert (padding lanes count in bin BLOCK_E - 1 >= num_experts, ignored)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_P):
        ids = tl.load(Topk_ids + start + offs_p, mask=start + offs_p < num_pairs,
                      other=BLOCK_E - 1)
        counts += tl.histogram(ids, BLOCK_E)
    counts = tl.where(offs_e < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    run_starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(Total, total)
    tl.store(Cursor + offs_e, run_starts)
    # 2. the sentinel over the padded runs (the GEMMs read no block at or past `total`)
    offs_f = tl.arange(0, BLOCK_FILL)
    for start in range(0, total, BLOCK_FILL):
        tl.store(Sorted_ids + start + offs_f, tl.zeros([BLOCK_FILL], dtype=tl.int32) + num_pairs,
                 mask=start + offs_f < total)
    # 3. the expert of each block: expert e owns blocks run_start / BLOCK_M + j, j < its
    # padded / BLOCK_M (vectors over experts; a [blocks, experts] comparison was [256, 1024]
    # values a step at 512 experts, where the kernel took 75 us a layer on an H200)
    first_block = run_starts // BLOCK_M
    blocks = padded // BLOCK_M
    for j in range(0, tl.max(blocks, 0)):
        tl.store(Expert_ids + first_block + j, offs_e, mask=j < blocks)
    tl.debug_barrier()
    # 4. scatter: rank = the expert's cursor + earlier pairs of the same expert in this chunk
    for start in range(0, num_pairs, BLOCK_P):
        valid = start + offs_p < num_pairs
        ids = tl.load(Topk_ids + start + offs_p, mask=valid, other=BLOCK_E - 1)
        same = (ids[:, None] == ids[None, :]) & (offs_p[None, :] < offs_p[:, None])
        rank = tl.sum(same.to(tl.int32), 1)
        base = tl.load(Cursor + ids, mask=valid, other=0)
        tl.store(Sorted_ids + base + rank, (start + offs_p).to(tl.int32), mask=valid)
        tl.debug_barrier()
        cursor = tl.load(Cursor + offs_e)
        chunk_counts = tl.histogram(ids, BLOCK_E)
        tl.store(Cursor + offs_e, cursor + chunk_counts)
        tl.debug_barrier()


def moe_align_block_size_triton(topk_ids: torch.Tensor, block_m: int, num_experts: int
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as fused_moe.moe_align_block_size (pair order within an expert kept), up
    to the padded total: sorted ids and expert ids past it are left unwritten."""
    flat = topk_ids.reshape(-1).to(torch.int32)
    num_pairs = flat.numel()
    max_padded = num_pairs + num_experts * (block_m - 1)
    num_blocks = triton.cdiv(max_padded, block_m)
    device = flat.device
    block_e = triton.next_power_of_2(num_experts + 1)  # one spare bin for padding lanes
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(block_e, dtype=torch.int32, device=device)
    _moe_align_kernel[(1,)](flat, sorted_ids, expert_ids, total, cursor, num_pairs, num_experts,
                            BLOCK_M=block_m, BLOCK_E=block_e,
                            BLOCK_P=64, BLOCK_FILL=256, num_warps=4)
    return sorted_ids, expert_ids, total
