"""Split-KV decode kernel vs the gather-and-softmax reference (CPU interpreter, and GPU)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from attn_testkit import DEVICE, gpu, needs_cuda, random_pool, tolerance  # noqa: E402
from radixserve.attention.kernels.decode_attention import (  # noqa: E402
    DecodeKernelConfig, decode_attention_fwd, decode_workspace_shapes)
from radixserve.attention.kernels.reference import decode_attention_reference  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

SMALL = DecodeKernelConfig(block_n=16, num_warps=2, num_stages=1)


# the kernel variants' dtypes: the GPU runs each; the interpreter (CPU CI) runs fp16 only, the
# activations' dtype on GPUs (its float32 arithmetic is the same for both; the plain kernel's
# tests below still run both)
VARIANT_DTYPES = [torch.float16, torch.float32, torch.bfloat16] if torch.cuda.is_available() \
    else [torch.float16]


def run_decode(seq_lens: list[int], num_kv_heads: int, group: int, head_dim: int,
               dtype: torch.dtype, num_kv_splits: int, config: DecodeKernelConfig,
               seed: int = 0, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out, ref, _ = run_decode_with_lse(seq_lens, num_kv_heads, group, head_dim, dtype,
                                      num_kv_splits, config, seed, **options)
    return out, ref


def run_decode_with_lse(seq_lens: list[int], num_kv_heads: int, group: int, head_dim: int,
                        dtype: torch.dtype, num_kv_splits: int, config: DecodeKernelConfig,
                        seed: int = 0, q_scale: float = 1.0, **options: Any,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """options: sliding_window / logit_cap, for the kernel and the reference alike. q_scale
    scales q, so that scores are large enough for a logit cap to matter."""
    pool = random_pool(seq_lens, num_kv_heads, head_dim, dtype, seed=seed)
    num_heads = num_kv_heads * group
    gen = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn((len(seq_lens), num_heads, head_dim), generator=gen) * q_scale).to(
        dtype).to(DEVICE)
    out_shape, lse_shape = decode_workspace_shapes(len(seq_lens), num_heads, num_kv_splits,
                                                   head_dim)
    mid_out = torch.full(out_shape, float("nan"), device=DEVICE)  # unwritten splits stay NaN
    mid_lse = torch.full(lse_shape, float("nan"), device=DEVICE)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, out, pool.req_to_token,
                         pool.req_pool_indices, pool.seq_lens, mid_out, mid_lse, scale, config,
                         **options)
    ref = decode_attention_reference(q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                     pool.req_pool_indices, pool.seq_lens, scale, **options)
    return out, ref, mid_lse


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_matches_reference(group: int, head_dim: int, dtype: torch.dtype) -> None:
    # ragged: 1 token, shorter than one block, exactly one split, many splits
    out, ref = run_decode([1, 13, 64, 75], num_kv_heads=2 if group == 1 else 1, group=group,
                          head_dim=head_dim, dtype=dtype, num_kv_splits=4, config=SMALL)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_early_v_load_matches_reference(num_kv_splits: int) -> None:
    """The variant that gathers V together with K gives the same attention."""
    config = DecodeKernelConfig(block_n=16, num_warps=2, num_stages=1, early_v=True)
    out, ref = run_decode([1, 13, 64, 75], num_kv_heads=2, group=4, head_dim=64,
                          dtype=torch.float16, num_kv_splits=num_kv_splits, config=config)
    torch.testing.assert_close(out, ref, **tolerance(torch.float16))


# the 3-split cases: 2.6 s each interpreted
@pytest.mark.parametrize("q_scale", [1.0, 8.0])
@pytest.mark.parametrize("num_kv_splits", [1, pytest.param(3, marks=pytest.mark.slow_interpreted)])
@pytest.mark.parametrize("dtype", VARIANT_DTYPES)
def test_decode_lazy_rescale_matches_reference(q_scale: float, num_kv_splits: int,
                                               dtype: torch.dtype) -> None:
    """A stale running max: with q x 8 (scores spread over tens of powers of two) later blocks
    pass it by more than LAZY_MAX_BITS and rescale mid-split; with q x 1 they almost never do,
    and the probabilities run up to 2^LAZY_MAX_BITS."""
    for config in (DecodeKernelConfig(block_n=16, num_warps=2, num_stages=1, lazy_rescale=True),
                   DecodeKernelConfig(block_n=32, num_warps=1, num_stages=2, early_v=True,
                                      lazy_rescale=True)):
        out, ref = run_decode([1, 13, 64, 75, 200], num_kv_heads=2, group=4, head_dim=64,
                              dtype=dtype, num_kv_splits=num_kv_splits, config=config, seed=7,
                              q_scale=q_scale)
        torch.testing.assert_close(out, ref, **tolerance(dtype))


# 3 splits already leave the shortest requests' later splits empty; 8 runs with --run-slow,
# 3 on a GPU (3.9 s interpreted)
@pytest.mark.parametrize("num_kv_splits", [1,
                                           pytest.param(3, marks=pytest.mark.slow_interpreted),
                                           pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", VARIANT_DTYPES)
def test_decode_early_kv_matches_reference(num_kv_splits: int, dtype: torch.dtype) -> None:
    """The first block of each split gathered before the PDL wait, this step's own position
    read after it: the own position falls in a first block (short requests, the last split's
    only block) or in a later one, and splits beyond the request are empty."""
    for config in (DecodeKernelConfig(block_n=16, num_warps=2, num_stages=1, early_kv=True),
                   DecodeKernelConfig(block_n=16, num_warps=2, num_stages=2, early_v=True,
                                      lazy_rescale=True, early_kv=True)):
        out, ref = run_decode([1, 2, 13, 16, 17, 64, 75, 130], num_kv_heads=2, group=4,
                              head_dim=64, dtype=dtype, num_kv_splits=num_kv_splits,
                              config=config, seed=11)
        torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("variant", ["early_kv", "lazy_rescale"])
def test_decode_variant_with_window_and_cap(variant: str) -> None:
    config = DecodeKernelConfig(block_n=16, num_warps=2, num_stages=1, **{variant: True})
    out, ref = run_decode([1, 40, 90], num_kv_heads=1, group=4, head_dim=64,
                          dtype=torch.float32, num_kv_splits=2, config=config, seed=9,
                          q_scale=8.0, sliding_window=50, logit_cap=20.0)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


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


# ---- sliding window and logit soft-capping ----

RAGGED = [1, 13, 64, 75, 130]


@pytest.mark.parametrize("window", [1, 20, 500])  # 500: larger than every context
@pytest.mark.parametrize("num_kv_splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_sliding_window(window: int, num_kv_splits: int, dtype: torch.dtype) -> None:
    out, ref = run_decode(RAGGED, num_kv_heads=1, group=4, head_dim=64, dtype=dtype,
                          num_kv_splits=num_kv_splits, config=SMALL, seed=11,
                          sliding_window=window)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_sliding_window_gqa(group: int) -> None:
    out, ref = run_decode(RAGGED, num_kv_heads=2 if group == 1 else 1, group=group,
                          head_dim=64, dtype=torch.float32, num_kv_splits=4, config=SMALL,
                          seed=12, sliding_window=24)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("window,splits_of_longest", [(40, 3), (50, 4)])
def test_decode_sliding_window_splits_cover_only_the_window(window: int,
                                                            splits_of_longest: int) -> None:
    """The split plan spreads the window, not the context, over the splits: a context of 300
    with a window of 40 uses 3 splits of 16 (not 4 of 80), and stage 2 merges exactly those."""
    seq_lens, num_kv_splits, block = [300, 97, 40, 5], 4, SMALL.block_n
    out, ref, mid_lse = run_decode_with_lse(seq_lens, num_kv_heads=1, group=4, head_dim=64,
                                            dtype=torch.float32, num_kv_splits=num_kv_splits,
                                            config=SMALL, seed=13, sliding_window=window)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))
    for i, seq_len in enumerate(seq_lens):  # the plan of the module docstring
        win_len = min(seq_len, window)
        split_len = max(cdiv(cdiv(win_len, num_kv_splits), block) * block, block)
        used = cdiv(win_len, split_len)
        if i == 0:
            assert used == splits_of_longest
        assert torch.isfinite(mid_lse[i, :, :used]).all(), (seq_len, used)
        assert torch.isnan(mid_lse[i, :, used:]).all(), (seq_len, used)  # never written


@pytest.mark.parametrize("num_kv_splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_logit_cap(num_kv_splits: int, dtype: torch.dtype) -> None:
    # scores of std ~4 against a cap of 5: the cap changes the result a lot
    out, ref = run_decode(RAGGED, num_kv_heads=2, group=2, head_dim=64, dtype=dtype,
                          num_kv_splits=num_kv_splits, config=SMALL, seed=14, q_scale=4.0,
                          logit_cap=5.0)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    _, uncapped = run_decode(RAGGED, num_kv_heads=2, group=2, head_dim=64, dtype=dtype,
                             num_kv_splits=1, config=SMALL, seed=14, q_scale=4.0)
    assert not torch.allclose(ref, uncapped, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_sliding_window_and_logit_cap(dtype: torch.dtype) -> None:
    out, ref = run_decode(RAGGED, num_kv_heads=1, group=8, head_dim=80, dtype=dtype,
                          num_kv_splits=4, config=SMALL, seed=15, q_scale=3.0,
                          sliding_window=37, logit_cap=4.0)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: int, scale: float,
                    sliding_window: int, logit_cap: float) -> torch.Tensor:
    """One query ([H, D]) at absolute position q_idx over keys at positions 0..len(k)-1, in
    float64, written as Hugging Face does it: the causal mask and `sliding_window_overlay`
    (kv_idx > q_idx - sliding_window), then Gemma-2's eager soft cap (w / cap, tanh, * cap)."""
    num_heads, group = q.shape[0], q.shape[0] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        w = (kh @ q[h].double()) * scale
        if logit_cap > 0:
            w = w / logit_cap
            w = torch.tanh(w)
            w = w * logit_cap
        kv_idx = torch.arange(len(k))
        allowed = kv_idx <= q_idx
        if sliding_window > 0:
            allowed = allowed & (kv_idx > q_idx - sliding_window)
        w = torch.where(allowed, w, torch.tensor(float("-inf"), dtype=torch.float64))
        out[h] = torch.softmax(w, dim=0) @ vh
    return out


@pytest.mark.parametrize("sliding_window,logit_cap", [(-1, 0.0), (1, 0.0), (7, 0.0),
                                                      (100, 0.0), (-1, 2.5), (7, 2.5)])
def test_decode_reference_matches_naive_hf_definition(sliding_window: int,
                                                      logit_cap: float) -> None:
    seq_lens, num_kv_heads, group, head_dim = [1, 6, 30], 2, 2, 16
    pool = random_pool(seq_lens, num_kv_heads, head_dim, torch.float32, seed=16)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim,
                    generator=torch.Generator().manual_seed(17)).to(DEVICE) * 2
    ref = decode_attention_reference(q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                     pool.req_pool_indices, pool.seq_lens, 0.5,
                                     sliding_window=sliding_window, logit_cap=logit_cap)
    for i, seq_len in enumerate(seq_lens):
        slots = pool.req_to_token[pool.req_pool_indices[i], :seq_len].long()
        naive = naive_attention(q[i].cpu(), pool.k_buffer[slots].cpu(),
                                pool.v_buffer[slots].cpu(), seq_len - 1, 0.5, sliding_window,
                                logit_cap)
        torch.testing.assert_close(ref[i].cpu().double(), naive, atol=1e-5, rtol=1e-5)


@gpu
@needs_cuda
@pytest.mark.parametrize("window,logit_cap", [(1, 0.0), (256, 0.0), (1000, 30.0), (-1, 30.0)])
@pytest.mark.parametrize("group", [1, 8])
def test_decode_bf16_window_and_cap(window: int, logit_cap: float, group: int) -> None:
    out, ref = run_decode([1, 100, 1000, 3000, 17, 4096, 65, 64], num_kv_heads=8, group=group,
                          head_dim=128, dtype=torch.bfloat16, num_kv_splits=16,
                          config=DecodeKernelConfig(), q_scale=8.0, sliding_window=window,
                          logit_cap=logit_cap)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


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


@pytest.mark.parametrize("num_kv_splits", [1, 4])
# without a window on a GPU (2.3 s interpreted at 4 splits)
@pytest.mark.parametrize("window", [pytest.param(-1, marks=pytest.mark.slow_interpreted), 37])
def test_decode_sinks(num_kv_splits: int, window: int) -> None:
    """gpt-oss's sinks: each head's logit joins its softmax with no value, in the only split's
    output and in the merge of several; with a window too."""
    sinks = (torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2).to(DEVICE)
    out, ref = run_decode(RAGGED, num_kv_heads=2, group=4, head_dim=64, dtype=torch.float32,
                          num_kv_splits=num_kv_splits, config=SMALL, seed=16, q_scale=2.0,
                          sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))
    _, plain = run_decode(RAGGED, num_kv_heads=2, group=4, head_dim=64, dtype=torch.float32,
                          num_kv_splits=1, config=SMALL, seed=16, q_scale=2.0,
                          sliding_window=window)
    assert not torch.allclose(ref, plain, atol=1e-2)
