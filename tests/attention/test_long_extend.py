"""kernels/long_extend.py: one long extend run as two attention calls merged by log-sum-exp.

The layout (GQA query heads folded into query rows for the prefix, K/V repeated for the new
tokens) and the merge are checked with the plain-PyTorch stand-in for cuDNN against causal
attention computed directly; on a GPU, cuDNN itself against the same reference.
"""
from __future__ import annotations

import pytest
import torch

from attn_testkit import gpu, needs_cuda
from radixserve.attention.kernels.long_extend import (cudnn_attend, cudnn_usable,
                                                      long_extend_attention, reference_attend)


def direct_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     prefix_len: int, scale: float) -> torch.Tensor:
    """q [E, Hq, D] at positions prefix_len.. over keys/values [P + E, Hkv, D], causally."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("ehd,khd->hek", q.float(), k) * scale
    num_new, total = q.shape[0], keys.shape[0]
    visible = torch.arange(total)[None, :] <= (prefix_len + torch.arange(num_new))[:, None]
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("hek,khd->ehd", scores.softmax(-1), v)


def run_case(prefix_len: int, num_new: int, heads: tuple[int, int], dtype: torch.dtype,
             device: torch.device, attend: object, fp8: bool = False) -> None:
    gen = torch.Generator().manual_seed(prefix_len + num_new)
    num_heads, num_kv_heads = heads
    head_dim, pool = 64, prefix_len + num_new + 50
    k_buf = torch.randn(pool, num_kv_heads, head_dim, generator=gen).to(device)
    v_buf = torch.randn(pool, num_kv_heads, head_dim, generator=gen).to(device)
    scales = None
    if fp8:  # codes = value / scale, as the FP8 pool stores them
        scales = (0.5, 0.25)
        k_buf = (k_buf / scales[0]).to(torch.float8_e4m3fn)
        v_buf = (v_buf / scales[1]).to(torch.float8_e4m3fn)
    else:
        k_buf, v_buf = k_buf.to(dtype), v_buf.to(dtype)
    slots = (torch.randperm(pool, generator=gen)[:prefix_len + num_new]).to(device)
    q = torch.randn(num_new, num_heads, head_dim, generator=gen).to(dtype).to(device)
    out = torch.empty_like(q)
    long_extend_attention(q, k_buf, v_buf, slots, prefix_len, 0.125, out, scales, attend=attend)
    keys, values = k_buf[slots], v_buf[slots]
    if scales is not None:
        keys, values = keys.float() * scales[0], values.float() * scales[1]
    ref = direct_attention(q, keys, values, prefix_len, 0.125)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("prefix_len,num_new", [(0, 23), (37, 11), (200, 64)])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_layout_and_merge(prefix_len: int, num_new: int, heads: tuple[int, int]) -> None:
    run_case(prefix_len, num_new, heads, torch.float32, torch.device("cpu"), reference_attend)


def test_fp8_pool_is_dequantised() -> None:
    run_case(40, 9, (8, 2), torch.bfloat16, torch.device("cpu"), reference_attend, fp8=True)


def test_cudnn_unusable_off_gpu() -> None:
    assert not cudnn_usable(torch.device("cpu"))


@gpu
@needs_cuda
@pytest.mark.parametrize("prefix_len,num_new", [(0, 1000), (3000, 1000), (5000, 37)])
def test_cudnn_matches_reference(prefix_len: int, num_new: int) -> None:
    if not cudnn_usable(torch.device("cuda")):
        pytest.skip("cuDNN attention does not run here")
    run_case(prefix_len, num_new, (32, 8), torch.bfloat16, torch.device("cuda"), cudnn_attend)
    run_case(prefix_len, num_new, (32, 8), torch.bfloat16, torch.device("cuda"), cudnn_attend,
             fp8=True)
