"""The CPU backend (attention/cpu_backend.py) and its compiled kernels (core/cpu_kernels).

The decode kernel is checked against attention/kernels/reference.py on random pools (shuffled
slots and rows, GQA, windows, soft-caps); the backend against torch_native through real pools:
EXTEND on a shared cached prefix, DECODE and MIXED passes with rope (extend runs through the
per-token kernel and, past its length limit, the padded SDPA), the same outputs and the same
K/V in the pool.
"""
from __future__ import annotations

import pytest
import torch

from attn_testkit import PoolDriver, random_pool, tolerance
from radixserve.attention.cpu_backend import CPUAttnBackend
from radixserve.attention.kernels.reference import decode_attention_reference
from radixserve.attention.torch_native import TorchNativeAttnBackend
from radixserve.core.cpu_kernels import cpu_ops
from radixserve.core.forward_batch import ForwardMode
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary import RopeInput, RotaryEmbedding, default_inv_freq

ops = cpu_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason="CPU kernels did not build")
DTYPES = [torch.float32, torch.bfloat16]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("window,cap,chunk", [(0, 0.0, 0), (5, 0.0, 0), (0, 30.0, 0),
                                              (0, 0.0, 16)])
def test_decode_kernel_matches_reference(dtype: torch.dtype, num_heads: int,
                                         num_kv_heads: int, window: int, cap: float,
                                         chunk: int) -> None:
    seq_lens = [1, 7, 33, 64, 2]
    pool = random_pool(seq_lens, num_kv_heads, 64, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    # strided rows, as the q part of one qkv projection output
    qkv = torch.randn(len(seq_lens), (num_heads + 2) * 64, generator=gen).to(dtype)
    q = qkv[:, :num_heads * 64].view(len(seq_lens), num_heads, 64)
    out = torch.empty(len(seq_lens), num_heads, 64, dtype=dtype)
    ops.decode_attention(q, pool.k_buffer, pool.v_buffer, out, pool.req_to_token,
                         pool.req_pool_indices, pool.seq_lens, 0.125, cap, window, chunk)
    ref = decode_attention_reference(q, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                                     pool.req_pool_indices, pool.seq_lens, 0.125,
                                     sliding_window=window or -1, logit_cap=cap,
                                     attention_chunk=chunk)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 6, 2, 32, 3


class Driver(PoolDriver):
    def __init__(self, backend_cls: type, dtype: torch.dtype) -> None:
        super().__init__(backend_cls, dtype, torch.device("cpu"), NUM_KV_HEADS, HEAD_DIM,
                         NUM_LAYERS, num_heads=NUM_HEADS)
        # layer 1 has an attention window, layer 2 a logit soft-cap
        self.layers = [RadixAttention(NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, NUM_KV_HEADS, i,
                                      sliding_window=6 if i == 1 else None,
                                      logit_cap=20.0 if i == 2 else 0.0)
                       for i in range(NUM_LAYERS)]
        self.rotary = RotaryEmbedding(HEAD_DIM, 256, default_inv_freq(HEAD_DIM, 10000.0))
        self.gen = torch.Generator().manual_seed(0)

    def run(self, fb: object) -> list[torch.Tensor]:
        self.backend.init_forward_metadata(fb)
        outs = []
        width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        for layer in self.layers:
            qkv = torch.randn(fb.num_tokens, width, generator=self.gen).to(self.dtype)
            q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM,
                                 NUM_KV_HEADS * HEAD_DIM], dim=-1)
            outs.append(layer(q, k, v, fb, RopeInput(fb.positions, self.rotary)))
        return outs


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extend_kernel_max", [256, 3])  # 3: extend runs take the padded SDPA
def test_backend_matches_torch_native(dtype: torch.dtype, extend_kernel_max: int,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import radixserve.attention.cpu_backend as cpu_backend
    monkeypatch.setattr(cpu_backend, "EXTEND_KERNEL_MAX_TOKENS", extend_kernel_max)
    drivers = [Driver(CPUAttnBackend, dtype), Driver(TorchNativeAttnBackend, dtype)]
    assert drivers[0].backend.ops is not None
    results: list[list[list[torch.Tensor]]] = [[], []]
    for i, d in enumerate(drivers):
        a = d.new_request()
        results[i].append(d.run(d.batch(ForwardMode.EXTEND, [a], [12])))
        b = d.new_request(shared_prefix_from=a, prefix_len=8)  # a radix-cache hit
        c = d.new_request()
        results[i].append(d.run(d.batch(ForwardMode.EXTEND, [b, c], [5, 9])))
        for _ in range(3):
            results[i].append(d.run(d.batch(ForwardMode.DECODE, [a, b, c], [1, 1, 1])))
        e = d.new_request()
        # MIXED: a prefill chunk, then one decode token of each running request
        results[i].append(d.run(d.batch(ForwardMode.MIXED, [e, a, b, c], [4, 1, 1, 1])))
    tol = tolerance(dtype)
    for fast, ref in zip(*results):
        for out_fast, out_ref in zip(fast, ref):
            torch.testing.assert_close(out_fast, out_ref, **tol)
    for layer in range(NUM_LAYERS):  # rope + store wrote the same K/V, bit for bit
        for fast_buf, ref_buf in zip(drivers[0].kv_pool.kv_buffers(layer),
                                     drivers[1].kv_pool.kv_buffers(layer)):
            assert torch.equal(fast_buf, ref_buf)


def test_backend_falls_back_without_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    import radixserve.attention.cpu_backend as cpu_backend
    monkeypatch.setattr(cpu_backend, "cpu_ops", lambda: None)
    drivers = [Driver(CPUAttnBackend, torch.float32), Driver(TorchNativeAttnBackend,
                                                             torch.float32)]
    assert drivers[0].backend.ops is None
    outs = []
    for d in drivers:
        a = d.new_request()
        d.run(d.batch(ForwardMode.EXTEND, [a], [6]))
        outs.append(d.run(d.batch(ForwardMode.DECODE, [a], [1])))
    for x, y in zip(*outs):
        assert torch.equal(x, y)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_take_the_kernel_in_fp32_only(dtype: torch.dtype) -> None:
    """bf16 prompts keep the padded SDPA (Hugging Face's rounding); fp32 ones the kernel."""
    driver = Driver(CPUAttnBackend, dtype)
    assert driver.backend.extend_by_kernel == (dtype == torch.float32)
    a = driver.new_request()
    driver.backend.init_forward_metadata(driver.batch(ForwardMode.EXTEND, [a], [5]))
    assert (driver.backend._token_rows is not None) == (dtype == torch.float32)
