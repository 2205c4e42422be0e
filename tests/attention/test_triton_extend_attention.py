"""Prefix-aware extend kernel vs the gather-and-causal-softmax reference."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attn_testkit import DEVICE, gpu, needs_cuda, random_pool, tolerance  # noqa: E402
from radixserve.attention.kernels.extend_attention import (  # noqa: E402
    ExtendKernelConfig, default_extend_config, extend_attention_fwd)
from radixserve.attention.kernels.reference import extend_attention_reference  # noqa: E402

SMALL = ExtendKernelConfig(block_m=16, block_n=16, num_warps=2, num_stages=1)
TALL = ExtendKernelConfig(block_m=32, block_n=16, num_warps=2, num_stages=1)


def run_extend(prefix_lens: list[int], extend_lens: list[int], num_kv_heads: int, group: int,
               head_dim: int, dtype: torch.dtype, config: ExtendKernelConfig | None,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool holds each request's prefix; the new tokens' k/v come packed, as in a pass."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = random_pool(seq_lens, num_kv_heads, head_dim, dtype, seed=seed)
    num_heads, num_tokens = num_kv_heads * group, sum(extend_lens)
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)

    q = rand(num_tokens, num_heads, head_dim)
    k_ext, v_ext = rand(num_tokens, num_kv_heads, head_dim), rand(num_tokens, num_kv_heads,
                                                                  head_dim)
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    as_tensor = lambda values: torch.tensor(values, device=DEVICE)  # noqa: E731
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    extend_attention_fwd(q, k_ext, v_ext, out, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                         pool.req_pool_indices, as_tensor(starts), as_tensor(extend_lens),
                         as_tensor(prefix_lens), max(extend_lens), scale, config)
    ref = extend_attention_reference(q, k_ext, v_ext, pool.k_buffer, pool.v_buffer,
                                     pool.req_to_token, pool.req_pool_indices,
                                     as_tensor(prefix_lens), as_tensor(extend_lens), scale)
    return out, ref


RAGGED = ([0, 7, 40, 0], [1, 3, 20, 17])


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_extend_matches_reference(group: int, head_dim: int, dtype: torch.dtype) -> None:
    out, ref = run_extend(*RAGGED, num_kv_heads=2 if group == 1 else 1, group=group,
                          head_dim=head_dim, dtype=dtype, config=SMALL)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("prefix_lens,extend_lens", [
    ([0], [37]),          # plain prefill, batch 1
    ([150], [5]),         # long prefix, few new tokens
    ([64, 0, 3], [64, 1, 70]),  # block-aligned lengths next to ragged ones
])
def test_extend_prefix_shapes(prefix_lens: list[int], extend_lens: list[int]) -> None:
    out, ref = run_extend(prefix_lens, extend_lens, num_kv_heads=1, group=4, head_dim=64,
                          dtype=torch.float32, config=TALL, seed=2)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def test_extend_non_power_of_two_head_dim() -> None:
    out, ref = run_extend([10, 0], [20, 9], num_kv_heads=1, group=2, head_dim=80,
                          dtype=torch.float32, config=SMALL, seed=4)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@gpu
@needs_cuda
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("prefix_lens,extend_lens", [
    ([0], [4096]),
    ([0, 1000, 3000, 5, 0], [1024, 1, 700, 129, 2000]),
])
def test_extend_bf16_real_shapes(group: int, head_dim: int, prefix_lens: list[int],
                                 extend_lens: list[int]) -> None:
    out, ref = run_extend(prefix_lens, extend_lens, num_kv_heads=8, group=group,
                          head_dim=head_dim, dtype=torch.bfloat16,
                          config=default_extend_config(head_dim))
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


@gpu
@needs_cuda
def test_extend_fp16_other_block_sizes() -> None:
    for config in (ExtendKernelConfig(64, 64, 4, 2), ExtendKernelConfig(128, 32, 8, 3)):
        out, ref = run_extend([0, 300], [900, 257], num_kv_heads=8, group=4, head_dim=128,
                              dtype=torch.float16, config=config)
        torch.testing.assert_close(out, ref, **tolerance(torch.float16))
