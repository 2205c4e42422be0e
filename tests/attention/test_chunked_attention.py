"""Chunked attention (Llama-4's local layers: the query at position p sees only keys
(p // C) * C <= j <= p) in the reference, the Triton decode and extend kernels (in the
interpreter on CPU) and through every backend's pass, torch_native's masks, the CPU backend's
kernel (decode and per-token extend) and the Triton backend, with cached prefixes, prompts cut
across chunk boundaries and decode steps on both sides of a boundary."""
from __future__ import annotations

import pytest
import torch

from attn_testkit import DEVICE, PoolDriver, gpu, needs_cuda, random_pool, tolerance
from radixserve.attention.cpu_backend import CPUAttnBackend
from radixserve.attention.kernels.reference import (decode_attention_reference,
                                                    extend_attention_reference)
from radixserve.attention.torch_native import TorchNativeAttnBackend
from radixserve.core.forward_batch import ForwardMode
from radixserve.layers.radix_attention import RadixAttention


def test_reference_mask_is_transformers_chunked_overlay() -> None:
    """The reference's chunked mask against transformers' own (masking_utils)."""
    from transformers.masking_utils import and_masks, causal_mask_function, chunked_overlay
    from radixserve.attention.kernels.reference import _attention_mask
    chunk, length = 5, 23
    hf = and_masks(chunked_overlay(chunk, torch.zeros(1, dtype=torch.long)),
                   causal_mask_function)
    idx = torch.arange(length)
    want = hf(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :])
    got = _attention_mask(torch.arange(length), torch.arange(length), -1, None, chunk)
    assert torch.equal(got, want)
    assert not want[7, 4] and want[7, 5]  # position 7 sees its chunk (5..7) only


# ---- the Triton kernels against the reference ----

def _triton_kernels():
    pytest.importorskip("triton")
    from radixserve.attention.kernels.decode_attention import (
        DecodeKernelConfig, decode_attention_fwd, decode_workspace_shapes)
    from radixserve.attention.kernels.extend_attention import (ExtendKernelConfig,
                                                               extend_attention_fwd)
    return (DecodeKernelConfig, decode_attention_fwd, decode_workspace_shapes,
            ExtendKernelConfig, extend_attention_fwd)


# lengths on both sides of chunk boundaries (chunk 16: 16, 17, 32, 33), one chunk and many
DECODE_LENS = [1, 15, 16, 17, 33, 64, 75]


@pytest.mark.kernel
@pytest.mark.parametrize("chunk,num_kv_splits", [(4, 4), (16, 1), (24, 4)])
def test_decode_kernel_chunked(chunk: int, num_kv_splits: int) -> None:
    config_cls, decode, shapes, _, _ = _triton_kernels()
    dtype = torch.float32
    pool = random_pool(DECODE_LENS, 2, 32, dtype, seed=chunk)
    gen = torch.Generator().manual_seed(chunk + 1)
    q = torch.randn(len(DECODE_LENS), 8, 32, generator=gen).to(DEVICE)
    out_shape, lse_shape = shapes(len(DECODE_LENS), 8, num_kv_splits, 32)
    mid_out = torch.full(out_shape, float("nan"), device=DEVICE)
    mid_lse = torch.full(lse_shape, float("nan"), device=DEVICE)
    out = torch.empty_like(q)
    decode(q, pool.k_buffer, pool.v_buffer, out, pool.req_to_token, pool.req_pool_indices,
           pool.seq_lens, mid_out, mid_lse, 32 ** -0.5,
           config_cls(block_n=16, num_warps=2, num_stages=1), attention_chunk=chunk)
    ref = decode_attention_reference(q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                     pool.req_pool_indices, pool.seq_lens, 32 ** -0.5,
                                     attention_chunk=chunk)
    full = decode_attention_reference(q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                      pool.req_pool_indices, pool.seq_lens, 32 ** -0.5)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    assert not torch.allclose(ref, full)  # the chunks matter


def _run_extend(prefix_lens: list[int], extend_lens: list[int], chunk: int,
                dtype: torch.dtype, block_m: int, seed: int) -> tuple[torch.Tensor, ...]:
    _, _, _, config_cls, extend = _triton_kernels()
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = random_pool(seq_lens, 1, 32, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = sum(extend_lens)
    q, k, v = (torch.randn(tokens, heads, 32, generator=gen).to(dtype).to(DEVICE)
               for heads in (4, 1, 1))
    as_tensor = lambda values: torch.tensor(values, device=DEVICE)  # noqa: E731
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    out = torch.full_like(q, float("nan"))
    extend(q, k, v, out, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
           as_tensor(starts), as_tensor(extend_lens), as_tensor(prefix_lens), max(extend_lens),
           32 ** -0.5, config_cls(block_m=block_m, block_n=16, num_warps=2, num_stages=1),
           attention_chunk=chunk)
    refs = [extend_attention_reference(q, k, v, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                       pool.req_pool_indices, as_tensor(prefix_lens),
                                       as_tensor(extend_lens), 32 ** -0.5,
                                       attention_chunk=c) for c in (chunk, 0)]
    return out, *refs


@pytest.mark.kernel
@pytest.mark.parametrize("chunk,block_m", [(4, 32), (16, 16), (40, 32), (1000, 32)])
def test_extend_kernel_chunked(chunk: int, block_m: int) -> None:
    """Prefixes ending inside, at and past chunk boundaries; runs of new tokens within one
    chunk and across several (the blocks before a query's chunk skipped, the boundary block
    masked, in the prefix pass and among the new tokens)."""
    out, ref, full = _run_extend([0, 7, 40, 0, 150, 16], [1, 3, 20, 45, 70, 33], chunk,
                                 torch.float32, block_m, seed=chunk + block_m)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))
    assert torch.allclose(ref, full) == (chunk == 1000)


@gpu
@needs_cuda
@pytest.mark.parametrize("chunk", [64, 8192])
def test_chunked_kernels_bf16_real_shapes(chunk: int) -> None:
    """Llama-4 Scout's heads (40 query, 8 KV, width 128) in bf16 at the GPU's block sizes,
    prompts and decode lengths past several chunks."""
    _, decode, shapes, _, extend = _triton_kernels()
    from radixserve.attention.kernels.decode_attention import default_decode_config
    from radixserve.attention.kernels.extend_attention import default_extend_config
    dtype = torch.bfloat16
    prefix_lens, extend_lens = [0, 300, 9000, 64], [1000, 129, 700, 1]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = random_pool(seq_lens, 8, 128, dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    tokens = sum(extend_lens)
    q, k, v = (torch.randn(tokens, heads, 128, generator=gen).to(dtype).to(DEVICE)
               for heads in (40, 8, 8))
    as_tensor = lambda values: torch.tensor(values, device=DEVICE)  # noqa: E731
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    out = torch.empty_like(q)
    extend(q, k, v, out, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
           as_tensor(starts), as_tensor(extend_lens), as_tensor(prefix_lens), max(extend_lens),
           128 ** -0.5, default_extend_config(128), attention_chunk=chunk)
    ref = extend_attention_reference(q, k, v, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                     pool.req_pool_indices, as_tensor(prefix_lens),
                                     as_tensor(extend_lens), 128 ** -0.5, attention_chunk=chunk)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    q1 = torch.randn(len(seq_lens), 40, 128, generator=gen).to(dtype).to(DEVICE)
    out_shape, lse_shape = shapes(len(seq_lens), 40, 8, 128)
    mid_out = torch.empty(out_shape, device=DEVICE)
    mid_lse = torch.empty(lse_shape, device=DEVICE)
    out1 = torch.empty_like(q1)
    decode(q1, pool.k_buffer, pool.v_buffer, out1, pool.req_to_token, pool.req_pool_indices,
           pool.seq_lens, mid_out, mid_lse, 128 ** -0.5, default_decode_config(dtype, 8),
           attention_chunk=chunk)
    ref1 = decode_attention_reference(q1, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                      pool.req_pool_indices, pool.seq_lens, 128 ** -0.5,
                                      attention_chunk=chunk)
    torch.testing.assert_close(out1, ref1, **tolerance(dtype))


# ---- every backend, through a pass ----

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, CHUNK = 4, 2, 32, 8


def _triton(context):
    from radixserve.attention.triton_backend import TritonAttnBackend
    return TritonAttnBackend(context, num_kv_splits=4, num_sms=2)


BACKENDS = {"torch_native": (TorchNativeAttnBackend, "cpu"),
            "cpu": (CPUAttnBackend, "cpu"),
            "triton": (_triton, DEVICE)}


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_attends_within_chunks(name: str) -> None:
    """A chunked layer beside a full one: a prompt whose cached prefix ends mid-chunk, a fresh
    prompt over three chunks, then decode steps at and past a chunk's end (several requests in
    one decode pass, their positions in different chunks)."""
    if name == "triton":
        pytest.importorskip("triton")
    make_backend, device = BACKENDS[name]
    driver = PoolDriver(make_backend, torch.float32, torch.device(device), NUM_KV_HEADS,
                        HEAD_DIM, 2, num_heads=NUM_HEADS)
    layers = [RadixAttention(NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, NUM_KV_HEADS, i,
                             attention_chunk=CHUNK if i == 0 else None) for i in range(2)]
    gen = torch.Generator().manual_seed(11)
    first = driver.new_request()
    _check(driver, layers, driver.batch(ForwardMode.EXTEND, [first], [13]), gen)
    a = driver.new_request(shared_prefix_from=first, prefix_len=11)
    b = driver.new_request()
    _check(driver, layers, driver.batch(ForwardMode.EXTEND, [a, b], [14, 23]), gen)
    for _ in range(3):  # a at 25..27, b at 23..25: both cross position 24
        _check(driver, layers, driver.batch(ForwardMode.DECODE, [a, b], [1, 1]), gen)


def _check(driver: PoolDriver, layers: list[RadixAttention], fb, gen: torch.Generator) -> None:
    driver.backend.init_forward_metadata(fb)
    for layer in layers:
        q, k, v = (torch.randn(fb.num_tokens, heads * HEAD_DIM, generator=gen).to(
            fb.input_ids.device) for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
        out = layer(q, k, v, fb)
        k_buf, v_buf = driver.kv_pool.kv_buffers(layer.layer_id)
        if fb.forward_mode.is_decode():
            ref = decode_attention_reference(
                q.view(-1, NUM_HEADS, HEAD_DIM), k_buf, v_buf, driver.req_pool.req_to_token,
                fb.req_pool_indices, fb.seq_lens, layer.scaling,
                attention_chunk=layer.attention_chunk or 0)
        else:
            ref = extend_attention_reference(
                q.view(-1, NUM_HEADS, HEAD_DIM), k.view(-1, NUM_KV_HEADS, HEAD_DIM),
                v.view(-1, NUM_KV_HEADS, HEAD_DIM), k_buf, v_buf, driver.req_pool.req_to_token,
                fb.req_pool_indices, fb.extend_prefix_lens, fb.extend_seq_lens, layer.scaling,
                attention_chunk=layer.attention_chunk or 0)
        torch.testing.assert_close(out.view(-1, NUM_HEADS, HEAD_DIM), ref,
                                   **tolerance(torch.float32))
