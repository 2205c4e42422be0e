"""Prefix-aware extend kernel vs the gather-and-causal-softmax reference."""
from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from attn_testkit import DEVICE, gpu, needs_cuda, random_pool, tolerance  # noqa: E402
from radixserve.attention.kernels.extend_attention import (  # noqa: E402
    ExtendKernelConfig, default_extend_config, extend_attention_fwd)
from radixserve.attention.kernels.reference import extend_attention_reference  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

SMALL = ExtendKernelConfig(block_m=16, block_n=16, num_warps=2, num_stages=1)
TALL = ExtendKernelConfig(block_m=32, block_n=16, num_warps=2, num_stages=1)


def run_extend(prefix_lens: list[int], extend_lens: list[int], num_kv_heads: int, group: int,
               head_dim: int, dtype: torch.dtype, config: ExtendKernelConfig | None,
               seed: int = 0, q_scale: float = 1.0,
               **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool holds each request's prefix; the new tokens' k/v come packed, as in a pass.

    options: sliding_window / logit_cap, for the kernel and the reference alike. q_scale scales
    q, so that scores are large enough for a logit cap to matter."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = random_pool(seq_lens, num_kv_heads, head_dim, dtype, seed=seed)
    num_heads, num_tokens = num_kv_heads * group, sum(extend_lens)
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)

    q = rand(num_tokens, num_heads, head_dim)
    if q_scale != 1.0:
        q = (q.float() * q_scale).to(dtype)
    k_ext, v_ext = rand(num_tokens, num_kv_heads, head_dim), rand(num_tokens, num_kv_heads,
                                                                  head_dim)
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    as_tensor = lambda values: torch.tensor(values, device=DEVICE)  # noqa: E731
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    extend_attention_fwd(q, k_ext, v_ext, out, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                         pool.req_pool_indices, as_tensor(starts), as_tensor(extend_lens),
                         as_tensor(prefix_lens), max(extend_lens), scale, config, **options)
    ref = extend_attention_reference(q, k_ext, v_ext, pool.k_buffer, pool.v_buffer,
                                     pool.req_to_token, pool.req_pool_indices,
                                     as_tensor(prefix_lens), as_tensor(extend_lens), scale,
                                     **options)
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


# ---- sliding window and logit soft-capping ----

# prefixes shorter and longer than the windows below, chunks of one token to several blocks
WINDOW_RAGGED = ([0, 7, 40, 0, 25], [1, 3, 20, 37, 45])


@pytest.mark.parametrize("window", [1, 10, 200])  # 200: larger than every context
@pytest.mark.parametrize("config", [SMALL, TALL], ids=["16x16", "32x16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_extend_sliding_window(window: int, config: ExtendKernelConfig,
                               dtype: torch.dtype) -> None:
    out, ref = run_extend(*WINDOW_RAGGED, num_kv_heads=1, group=2, head_dim=32, dtype=dtype,
                          config=config, seed=21, sliding_window=window)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("window", [12, 40])
@pytest.mark.parametrize("config", [SMALL, TALL], ids=["16x16", "32x16"])
def test_extend_window_crosses_prefix_boundary(window: int, config: ExtendKernelConfig) -> None:
    """Prefixes and chunks longer than the window: the first new tokens' windows reach into the
    prefix (whose earlier blocks are skipped), later ones lie among the new tokens alone (blocks
    before the window skipped, the boundary block masked, the rest of pass 2a unmasked)."""
    out, ref = run_extend([150, 45], [70, 37], num_kv_heads=1, group=2, head_dim=32,
                          dtype=torch.float32, config=config, seed=22, sliding_window=window)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@pytest.mark.parametrize("group", [1, 4, 8])
def test_extend_sliding_window_gqa(group: int) -> None:
    out, ref = run_extend(*WINDOW_RAGGED, num_kv_heads=2 if group == 1 else 1, group=group,
                          head_dim=64, dtype=torch.float32, config=TALL, seed=23,
                          sliding_window=17)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_extend_logit_cap(dtype: torch.dtype) -> None:
    # scores of std ~4 against a cap of 5: the cap changes the result a lot
    out, ref = run_extend(*WINDOW_RAGGED, num_kv_heads=1, group=2, head_dim=64, dtype=dtype,
                          config=TALL, seed=24, q_scale=4.0, logit_cap=5.0)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    _, uncapped = run_extend(*WINDOW_RAGGED, num_kv_heads=1, group=2, head_dim=64, dtype=dtype,
                             config=TALL, seed=24, q_scale=4.0)
    assert not torch.allclose(ref, uncapped, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_extend_sliding_window_and_logit_cap(dtype: torch.dtype) -> None:
    out, ref = run_extend([60, 0, 9], [50, 33, 1], num_kv_heads=1, group=4, head_dim=80,
                          dtype=dtype, config=TALL, seed=25, q_scale=3.0, sliding_window=21,
                          logit_cap=4.0)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor,
                    scale: float, sliding_window: int, logit_cap: float) -> torch.Tensor:
    """Queries [Tq, H, D] at absolute positions q_idx over keys at positions 0..len(k)-1, in
    float64, written as Hugging Face does it: the causal mask and `sliding_window_overlay`
    (kv_idx > q_idx - sliding_window), then Gemma-2's eager soft cap (w / cap, tanh, * cap)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    w = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if logit_cap > 0:
        w = w / logit_cap
        w = torch.tanh(w)
        w = w * logit_cap
    kv_idx, q_idx = torch.arange(len(k))[None, :], q_idx[:, None]
    allowed = kv_idx <= q_idx
    if sliding_window > 0:
        allowed = allowed & (kv_idx > q_idx - sliding_window)
    w = w.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(w, dim=-1), v)


@pytest.mark.parametrize("sliding_window,logit_cap", [(-1, 0.0), (1, 0.0), (5, 0.0),
                                                      (100, 0.0), (-1, 2.5), (5, 2.5)])
def test_extend_reference_matches_naive_hf_definition(sliding_window: int,
                                                      logit_cap: float) -> None:
    prefix_lens, extend_lens, num_kv_heads, group, head_dim = [0, 9], [6, 8], 2, 2, 16
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = random_pool(seq_lens, num_kv_heads, head_dim, torch.float32, seed=26)
    gen = torch.Generator().manual_seed(27)
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen) * 2
    k_ext = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v_ext = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    ref = extend_attention_reference(q.to(DEVICE), k_ext.to(DEVICE), v_ext.to(DEVICE),
                                     pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                     pool.req_pool_indices, torch.tensor(prefix_lens),
                                     torch.tensor(extend_lens), 0.5,
                                     sliding_window=sliding_window, logit_cap=logit_cap).cpu()
    start = 0
    for i, (prefix_len, ext_len) in enumerate(zip(prefix_lens, extend_lens)):
        slots = pool.req_to_token[pool.req_pool_indices[i], :prefix_len].long()
        end = start + ext_len
        k = torch.cat((pool.k_buffer[slots].cpu(), k_ext[start:end]))
        v = torch.cat((pool.v_buffer[slots].cpu(), v_ext[start:end]))
        naive = naive_attention(q[start:end], k, v, torch.arange(prefix_len, prefix_len + ext_len),
                                0.5, sliding_window, logit_cap)
        torch.testing.assert_close(ref[start:end].double(), naive, atol=1e-5, rtol=1e-5)
        start = end


@gpu
@needs_cuda
@pytest.mark.parametrize("window,logit_cap", [(1, 0.0), (256, 0.0), (1000, 30.0), (-1, 30.0)])
@pytest.mark.parametrize("group", [1, 8])
def test_extend_bf16_window_and_cap(window: int, logit_cap: float, group: int) -> None:
    out, ref = run_extend([0, 1000, 3000, 5, 0], [1024, 1, 700, 129, 2000], num_kv_heads=8,
                          group=group, head_dim=128, dtype=torch.bfloat16,
                          config=default_extend_config(128), q_scale=8.0,
                          sliding_window=window, logit_cap=logit_cap)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


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


@pytest.mark.parametrize("window", [-1, 17])
def test_extend_sinks(window: int) -> None:
    """gpt-oss's sinks: each head's logit joins its softmax with no value."""
    sinks = (torch.randn(4, generator=torch.Generator().manual_seed(4)) * 2).to(DEVICE)
    out, ref = run_extend(*WINDOW_RAGGED, num_kv_heads=2, group=2, head_dim=64,
                          dtype=torch.float32, config=TALL, seed=25, q_scale=2.0,
                          sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))
    _, plain = run_extend(*WINDOW_RAGGED, num_kv_heads=2, group=2, head_dim=64,
                          dtype=torch.float32, config=TALL, seed=25, q_scale=2.0,
                          sliding_window=window)
    assert not torch.allclose(ref, plain, atol=1e-2)


def image_limits(extend_lens: list[int], prefix_lens: list[int],
                 images: list[list[tuple[int, int]]]) -> torch.Tensor:
    """Each new token's limit where runs of positions (offset, length) see themselves whole,
    as the runner makes them for Gemma-3's images (core.multimodal.image_attention_limits)."""
    from radixserve.core.multimodal import ImageInput, image_attention_limits
    inputs = [[ImageInput(torch.zeros(1), offset, length, 0) for offset, length in runs]
              for runs in images]
    return torch.tensor(image_attention_limits(inputs, prefix_lens, extend_lens),
                        dtype=torch.int32, device=DEVICE)


# 2-3.4 s each interpreted: CI runs the windowless and the 9-window cases on 16x16 tiles
@pytest.mark.parametrize("window", [-1, 9, pytest.param(40, marks=pytest.mark.slow_interpreted)])
@pytest.mark.parametrize("config", [SMALL, pytest.param(TALL, marks=pytest.mark.slow_interpreted)],
                         ids=["16x16", "32x16"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, marks=pytest.mark.slow),
                                   torch.float32])
def test_extend_with_images_seen_both_ways(window: int, config: ExtendKernelConfig,
                                           dtype: torch.dtype) -> None:
    """Runs of new tokens that attend to each other both ways (Gemma-3's images): one inside a
    query block, one spanning blocks past the query block, one starting in the cached prefix
    side of the pass's first block; the rest causal; with and without a window."""
    prefix_lens, extend_lens = [0, 7, 3], [50, 41, 20]
    limits = image_limits(extend_lens, prefix_lens, [[(4, 6), (20, 25)], [(7, 30)], []])
    out, ref = run_extend(prefix_lens, extend_lens, 2, 2, 64, dtype, config,
                          sliding_window=window, causal_limit=limits)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    causal_out, _ = run_extend(prefix_lens, extend_lens, 2, 2, 64, dtype, config,
                               sliding_window=window)
    assert not torch.allclose(out[4:10], causal_out[4:10])  # the limits change the image rows
    torch.testing.assert_close(out[:4], causal_out[:4], **tolerance(dtype))
