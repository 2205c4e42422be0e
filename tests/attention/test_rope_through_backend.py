"""Rope handed to the attention backend (`RadixAttention(..., rope=RopeInput)`).

The Triton backend fuses rope with its KV-cache store (one kernel, no `_store_kv`); the
torch_native backend rotates through the default `AttentionBackend.forward`. Both run the same
schedule (extend on a shared prefix, decode, mixed) on their own pools, fed the same unrotated
q/k/v: their pools must agree and their outputs match within tolerance.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from typing import Any  # noqa: E402

from attn_testkit import DEVICE, PoolDriver, tolerance  # noqa: E402
from radixserve.attention.kernels.decode_attention import DecodeKernelConfig  # noqa: E402
from radixserve.attention.kernels.extend_attention import ExtendKernelConfig  # noqa: E402
from radixserve.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from radixserve.attention.triton_backend import TritonAttnBackend  # noqa: E402
from radixserve.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixserve.layers.radix_attention import RadixAttention, RopeInput  # noqa: E402
from radixserve.layers.rotary import RotaryEmbedding, default_inv_freq  # noqa: E402

# Triton kernels: native on a GPU, in the interpreter on CPU (see pyproject's markers)
pytestmark = pytest.mark.kernel

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 4, 2, 64, 2


class World(PoolDriver):
    """One backend with its own pools; every world gets the same slots for the same schedule."""

    def __init__(self, make_backend: Any, dtype: torch.dtype) -> None:
        super().__init__(make_backend, dtype, DEVICE, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS,
                         num_rows=4, max_context_len=64, num_slots=200, num_heads=NUM_HEADS)

    def batch(self, mode: ForwardMode, rows: list[int], extend_lens: list[int]) -> ForwardBatch:
        fb = super().batch(mode, rows, extend_lens)
        self.backend.init_forward_metadata(fb)
        return fb


def test_triton_fused_rope_store_matches_torch_native(monkeypatch: pytest.MonkeyPatch) -> None:
    dtype = torch.float32
    stores: list[int] = []
    original_store = TritonAttnBackend._store_kv

    def counting_store(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        stores.append(1)
        return original_store(self, *args, **kwargs)

    monkeypatch.setattr(TritonAttnBackend, "_store_kv", counting_store)
    def triton_backend(context: Any) -> TritonAttnBackend:
        return TritonAttnBackend(context, num_kv_splits=4, num_sms=2,
                                 decode_config=DecodeKernelConfig(16, 2, 1),
                                 extend_config=ExtendKernelConfig(16, 16, 2, 1))

    worlds = [World(triton_backend, dtype), World(TorchNativeAttnBackend, dtype)]
    layers = [RadixAttention(NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, NUM_KV_HEADS, i)
              for i in range(NUM_LAYERS)]
    rotary = RotaryEmbedding(HEAD_DIM, 128, default_inv_freq(HEAD_DIM, 10000.0)).to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM

    def run(make_batch) -> None:  # type: ignore[no-untyped-def]
        batches = [make_batch(w) for w in worlds]
        assert torch.equal(batches[0].out_cache_loc.cpu(), batches[1].out_cache_loc.cpu())
        for layer in layers:
            qkv = torch.randn(batches[0].num_tokens, width, generator=gen).to(dtype).to(DEVICE)
            outs = []
            for fb in batches:
                q, k, v = qkv.clone().split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM,
                                             NUM_KV_HEADS * HEAD_DIM], dim=-1)
                outs.append(layer(q, k, v, fb, RopeInput(fb.positions, rotary)))
            torch.testing.assert_close(outs[0], outs[1], **tolerance(dtype))
            pools = [w.kv_pool.kv_buffers(layer.layer_id) for w in worlds]
            torch.testing.assert_close(pools[0][0], pools[1][0], atol=1e-6, rtol=1e-6)
            assert torch.equal(pools[0][1], pools[1][1])

    rows: list[list[int]] = [[], []]
    for i, w in enumerate(worlds):
        rows[i].append(w.new_request())
    run(lambda w: w.batch(ForwardMode.EXTEND, [rows[worlds.index(w)][0]], [20]))
    for i, w in enumerate(worlds):
        rows[i] += [w.new_request(shared_prefix_from=rows[i][0], prefix_len=13),
                    w.new_request()]
    run(lambda w: w.batch(ForwardMode.EXTEND, rows[worlds.index(w)][1:], [6, 1]))
    for _ in range(2):
        run(lambda w: w.batch(ForwardMode.DECODE, rows[worlds.index(w)], [1, 1, 1]))
    for i, w in enumerate(worlds):
        rows[i].append(w.new_request(shared_prefix_from=rows[i][0], prefix_len=21))
    run(lambda w: w.batch(ForwardMode.MIXED, [rows[worlds.index(w)][j] for j in (3, 0, 2)],
                          [17, 1, 1]))
    assert not stores, "the Triton backend stored K/V again after the fused kernel"
