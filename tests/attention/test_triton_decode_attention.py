"""Split-KV decode kernel vs the gather-and-softmax reference (CPU interpreter, and GPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attn_testkit import DEVICE, gpu, needs_cuda, random_pool, tolerance  # noqa: E402
from radixserve.attention.kernels.decode_attention import (  # noqa: E402
    DecodeKernelConfig, decode_attention_fwd, decode_workspace_shapes)
from radixserve.attention.kernels.reference import decode_attention_reference  # noqa: E402

SMALL = DecodeKernelConfig(block_n=16, num_warps=2, num_stages=1)


def run_decode(seq_lens: list[int], num_kv_heads: int, group: int, head_dim: int,
               dtype: torch.dtype, num_kv_splits: int, config: DecodeKernelConfig,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    pool = random_pool(seq_lens, num_kv_heads, head_dim, dtype, seed=seed)
    num_heads = num_kv_heads * group
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn((len(seq_lens), num_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    out_shape, lse_shape = decode_workspace_shapes(len(seq_lens), num_heads, num_kv_splits,
                                                   head_dim)
    mid_out = torch.full(out_shape, float("nan"), device=DEVICE)  # unwritten splits stay NaN
    mid_lse = torch.full(lse_shape, float("nan"), device=DEVICE)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, out, pool.req_to_token,
                         pool.req_pool_indices, pool.seq_lens, mid_out, mid_lse, scale, config)
    ref = decode_attention_reference(q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                     pool.req_pool_indices, pool.seq_lens, scale)
    return out, ref


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_matches_reference(group: int, head_dim: int, dtype: torch.dtype) -> None:
    # ragged: 1 token, shorter than one block, exactly one split, many splits
    out, ref = run_decode([1, 13, 64, 75], num_kv_heads=2 if group == 1 else 1, group=group,
                          head_dim=head_dim, dtype=dtype, num_kv_splits=4, config=SMALL)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("num_kv_splits", [1, 2, 8])
def test_decode_batch_one_any_split_count(num_kv_splits: int) -> None:
    out, ref = run_decode([97], num_kv_heads=1, group=4, head_dim=64, dtype=torch.float32,
                          num_kv_splits=num_kv_splits, config=SMALL, seed=3)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def test_decode_non_power_of_two_head_dim() -> None:
    out, ref = run_decode([5, 40], num_kv_heads=1, group=2, head_dim=80, dtype=torch.float32,
                          num_kv_splits=2, config=SMALL, seed=5)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def test_decode_strided_query() -> None:
    """q as a view into a wider qkv projection, as the model produces it."""
    seq_lens, num_heads, num_kv_heads, head_dim = [9, 30], 4, 1, 64
    pool = random_pool(seq_lens, num_kv_heads, head_dim, torch.float32, seed=7)
    qkv = torch.randn(2, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    q = qkv[:, :num_heads * head_dim].view(2, num_heads, head_dim)
    mid_out = torch.empty(2, num_heads, 2, head_dim, device=DEVICE)
    mid_lse = torch.empty(2, num_heads, 2, device=DEVICE)
    out = torch.empty(2, num_heads, head_dim, device=DEVICE)
    decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, out, pool.req_to_token,
                         pool.req_pool_indices, pool.seq_lens, mid_out, mid_lse, 0.1, SMALL)
    ref = decode_attention_reference(q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                     pool.req_pool_indices, pool.seq_lens, 0.1)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@gpu
@needs_cuda
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seq_lens", [[4096], [1, 100, 1000, 3000, 17, 4096, 65, 64]])
def test_decode_bf16_real_shapes(group: int, head_dim: int, seq_lens: list[int]) -> None:
    out, ref = run_decode(seq_lens, num_kv_heads=8, group=group, head_dim=head_dim,
                          dtype=torch.bfloat16, num_kv_splits=16, config=DecodeKernelConfig())
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_large_batch(dtype: torch.dtype) -> None:
    seq_lens = torch.randint(1, 2000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    out, ref = run_decode(seq_lens, num_kv_heads=8, group=4, head_dim=128, dtype=dtype,
                          num_kv_splits=4, config=DecodeKernelConfig())
    torch.testing.assert_close(out, ref, **tolerance(dtype))
