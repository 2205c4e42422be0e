"""The Triton decode and extend kernels over an FP8 KV pool, with half-precision queries (the
path bf16/fp16 models take: FP8 codes multiplied unscaled in fp16, k_scale folded into the score
scale, v_scale into the weighted sum) and float32 ones, against the reference attention over
the dequantised pool."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from attn_testkit import DEVICE, random_pool  # noqa: E402
from radixserve.attention.kernels.decode_attention import (  # noqa: E402
    DecodeKernelConfig, decode_attention_fwd, decode_workspace_shapes, default_decode_config)
from radixserve.attention.kernels.extend_attention import (  # noqa: E402
    ExtendKernelConfig, extend_attention_fwd)
from radixserve.attention.kernels.reference import (  # noqa: E402
    decode_attention_reference, extend_attention_reference)

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

K_SCALE, V_SCALE = 0.02, 0.05
FP8 = torch.float8_e4m3fn
# bf16 only on a GPU: the interpreter's tl.dot is wrong on bf16 operands
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def _fp8_pool(seq_lens: list[int], num_kv_heads: int, head_dim: int, seed: int):
    """A pool in FP8 codes (value / scale) and its dequantised float32 twin."""
    pool = random_pool(seq_lens, num_kv_heads, head_dim, torch.float32, seed=seed)
    k_codes = (pool.k_buffer / K_SCALE).to(FP8)
    v_codes = (pool.v_buffer / V_SCALE).to(FP8)
    exact = dataclasses.replace(pool, k_buffer=k_codes.float() * K_SCALE,
                                v_buffer=v_codes.float() * V_SCALE)
    return dataclasses.replace(pool, k_buffer=k_codes, v_buffer=v_codes), exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("config", [
    DecodeKernelConfig(block_n=16, num_warps=2, num_stages=1),
    DecodeKernelConfig(block_n=16, num_warps=2, num_stages=1, early_v=True),
    default_decode_config(FP8, 1), default_decode_config(FP8, 3),
    DecodeKernelConfig(block_n=32, num_warps=1, num_stages=5, early_v=True, lazy_rescale=True),
    DecodeKernelConfig(block_n=16, num_warps=2, num_stages=2, early_v=True, early_kv=True)],
    ids=["plain", "early_v", "fp8_default_one_split", "fp8_default_split", "lazy_rescale",
         "early_kv"])
def test_decode_over_fp8_kv(dtype: torch.dtype, num_kv_splits: int,
                            config: DecodeKernelConfig) -> None:
    """fp8_default_*: the configs FP8 pools run (one split: one warp over 32-position tiles;
    several: two warps over 64; V with K in both)."""
    seq_lens, kv_heads, group, head_dim = [1, 13, 40], 2, 4, 64
    pool, exact = _fp8_pool(seq_lens, kv_heads, head_dim, seed=3)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    q = q.to(DEVICE)
    out_shape, lse_shape = decode_workspace_shapes(len(seq_lens), kv_heads * group,
                                                   num_kv_splits, head_dim)
    mid_out = torch.empty(out_shape, device=DEVICE)
    mid_lse = torch.empty(lse_shape, device=DEVICE)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, out, pool.req_to_token,
                         pool.req_pool_indices, pool.seq_lens, mid_out, mid_lse, scale,
                         config, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = decode_attention_reference(q.float(), exact.k_buffer, exact.v_buffer,
                                     exact.req_to_token, exact.req_pool_indices,
                                     exact.seq_lens, scale)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_over_an_fp8_prefix(dtype: torch.dtype) -> None:
    prefix_lens, extend_lens, kv_heads, group, head_dim = [0, 9, 30], [5, 3, 18], 2, 2, 64
    pool, exact = _fp8_pool([p + e for p, e in zip(prefix_lens, extend_lens)], kv_heads,
                            head_dim, seed=5)
    gen = torch.Generator().manual_seed(6)
    tokens = sum(extend_lens)
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    k_ext = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v_ext = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    starts = torch.tensor([sum(extend_lens[:i]) for i in range(3)], device=DEVICE)
    ext = torch.tensor(extend_lens, device=DEVICE)
    pre = torch.tensor(prefix_lens, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    extend_attention_fwd(q, k_ext, v_ext, out, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                         pool.req_pool_indices, starts, ext, pre, max(extend_lens), scale,
                         ExtendKernelConfig(block_m=16, block_n=16, num_warps=2, num_stages=1),
                         k_scale=K_SCALE, v_scale=V_SCALE)
    ref = extend_attention_reference(q.float(), k_ext.float(), v_ext.float(), exact.k_buffer,
                                     exact.v_buffer, exact.req_to_token,
                                     exact.req_pool_indices, pre, ext, scale)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
