"""LoRA deltas of rows that each name their own adapter slot (a decode step's requests), in two
Triton kernels, so a step whose requests mix adapters (or run none) is a fixed sequence of
launches a CUDA graph captures: the slots are read from device memory, not branched on in
Python.

For token t of slot s = slots[t] (s < 0: no adapter, the row is left as it is), with the
layer's stacks (layers/lora.py: A rows and B columns s * width .. (s + 1) * width):
  * shrink: low[t] = x[t] A_s^T, [width] — split over the input features so a batch of one
    still spreads over the GPU: program (split, row block, token) reads K_CHUNK features of
    BLOCK_R rows of A_s and writes its partial sums (float32, [splits, tokens, width]);
  * expand: out[t] += low[t] B_s^T — program (output block, token) sums the partials of its
    token (a few dozen values), reads B_s's [BLOCK_N, width] rows and adds into `out` in place
    (each output element has one owner: no atomics, the same sums every run).
The products are elementwise multiply-adds in float32 registers, not tensor-core tiles: a
token's A and B are its own adapter's, and at decode batch sizes the work is reading them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128  # input features a shrink step reads of each A row
K_STEPS = 4  # steps per shrink program: K_CHUNK = 512 features
K_CHUNK = BLOCK_K * K_STEPS
MAX_BLOCK_R = 32  # A rows a shrink program reads
EXPAND_TILE = 4096  # BLOCK_N x width_p elements of B an expand program reads


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, part_ptr, in_features, x_stride, a_stride,
                        num_tokens, WIDTH: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr):
    split = tl.program_id(0)
    row_block = tl.program_id(1)
    token = tl.program_id(2)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < WIDTH
        a_rows = a_ptr + (slot * WIDTH + rows).to(tl.int64)[:, None] * a_stride
        x_row = x_ptr + token.to(tl.int64) * x_stride
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        for step in tl.static_range(K_STEPS):
            ks = (split * K_STEPS + step) * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < in_features
            xs = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc += a.to(tl.float32) * xs[None, :]
        part = part_ptr + (split * num_tokens + token).to(tl.int64) * WIDTH + rows
        tl.store(part, tl.sum(acc, axis=1), mask=row_ok)


@triton.jit
def _lora_expand_kernel(part_ptr, b_ptr, slots_ptr, out_ptr, out_features, b_stride,
                        out_stride, num_tokens, num_splits, WIDTH: tl.constexpr,
                        WIDTH_P: tl.constexpr, SPLITS_P: tl.constexpr, BLOCK_N: tl.constexpr):
    n_block = tl.program_id(0)
    token = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        r = tl.arange(0, WIDTH_P)
        r_ok = r < WIDTH
        splits = tl.arange(0, SPLITS_P)
        parts = tl.load(part_ptr + (splits[:, None] * num_tokens + token) * WIDTH + r[None, :],
                        mask=(splits[:, None] < num_splits) & r_ok[None, :], other=0.0)
        low = tl.sum(parts, axis=0)  # [WIDTH_P]: x[t] A_s^T
        ns = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = ns < out_features
        b = tl.load(b_ptr + ns.to(tl.int64)[:, None] * b_stride + slot * WIDTH + r[None, :],
                    mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        delta = tl.sum(b.to(tl.float32) * low[None, :], axis=1)
        out = out_ptr + token.to(tl.int64) * out_stride + ns
        current = tl.load(out, mask=n_ok, other=0.0)
        tl.store(out, (current.to(tl.float32) + delta).to(current.dtype), mask=n_ok)


def add_lora_rows(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                  width: int, out: torch.Tensor) -> None:
    """out[t] += (x[t] A_s^T) B_s^T for every row t whose slot s = token_slots[t] >= 0, in
    place. x [tokens, in], a [slots x width, in], b [out, slots x width] (rows of x, a, b and
    out contiguous), token_slots [tokens] integers on x's device."""
    tokens, in_features = x.shape
    out_features = out.shape[1]
    if tokens == 0:
        return
    if x.stride(1) != 1 or a.stride(1) != 1 or b.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("add_lora_rows needs rows with contiguous elements")
    splits = triton.cdiv(in_features, K_CHUNK)
    block_r = min(triton.next_power_of_2(width), MAX_BLOCK_R)
    parts = torch.empty((splits, tokens, width), dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(splits, triton.cdiv(width, block_r), tokens)](
        x, a, token_slots, parts, in_features, x.stride(0), a.stride(0), tokens,
        WIDTH=width, BLOCK_R=block_r, BLOCK_K=BLOCK_K, K_STEPS=K_STEPS, num_warps=4)
    width_p = triton.next_power_of_2(width)
    block_n = max(16, min(128, EXPAND_TILE // width_p))
    _lora_expand_kernel[(triton.cdiv(out_features, block_n), tokens)](
        parts, b, token_slots, out, out_features, b.stride(0), out.stride(0), tokens, splits,
        WIDTH=width, WIDTH_P=width_p, SPLITS_P=triton.next_power_of_2(splits),
        BLOCK_N=block_n, num_warps=4)
