"""ForwardBatch.extend_causal_limit (Gemma-3's images: an image's tokens see their whole image)
through every backend's extend path, against attention/kernels/reference.py: torch_native's
padded SDPA, the CPU backend's per-token kernel (and its fallback for windowed layers), and
the Triton backend (in the interpreter on CPU); with a cached prefix, a window and a soft-cap."""
from __future__ import annotations

import pytest
import torch

from attn_testkit import DEVICE, PoolDriver, tolerance
from radixserve.attention.cpu_backend import CPUAttnBackend
from radixserve.attention.kernels.reference import extend_attention_reference
from radixserve.attention.torch_native import TorchNativeAttnBackend
from radixserve.core.forward_batch import ForwardMode
from radixserve.core.multimodal import ImageInput, image_attention_limits
from radixserve.layers.radix_attention import RadixAttention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32


def _triton(context):
    from radixserve.attention.triton_backend import TritonAttnBackend
    return TritonAttnBackend(context, num_kv_splits=4, num_sms=2)


BACKENDS = {"torch_native": (TorchNativeAttnBackend, "cpu"),
            "cpu": (CPUAttnBackend, "cpu"),
            "triton": (_triton, DEVICE)}


def _layers() -> list[RadixAttention]:
    """Plain, windowed (shorter than an image) and soft-capped layers."""
    return [RadixAttention(NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, NUM_KV_HEADS, i,
                           sliding_window=7 if i == 1 else None,
                           logit_cap=15.0 if i == 2 else 0.0) for i in range(3)]


@pytest.mark.parametrize("name", list(BACKENDS))
def test_an_image_sees_itself_whole_in_every_backend(name: str, monkeypatch) -> None:
    if name == "triton":
        pytest.importorskip("triton")
    make_backend, device = BACKENDS[name]
    driver = PoolDriver(make_backend, torch.float32, torch.device(device), NUM_KV_HEADS,
                        HEAD_DIM, 3, num_heads=NUM_HEADS)
    layers = _layers()
    gen = torch.Generator().manual_seed(3)
    first = driver.new_request()
    warm = driver.batch(ForwardMode.EXTEND, [first], [10])  # a cached prefix for the next
    _run(driver, layers, warm, gen, None)
    a = driver.new_request(shared_prefix_from=first, prefix_len=6)
    b = driver.new_request()
    fb = driver.batch(ForwardMode.EXTEND, [a, b], [30, 21])
    images = [[ImageInput(torch.zeros(1), 8, 12, 1), ImageInput(torch.zeros(1), 22, 9, 2)],
              [ImageInput(torch.zeros(1), 0, 16, 3)]]
    limits = image_attention_limits(images, [6, 0], [30, 21])
    fb.extend_causal_limit = torch.tensor(limits, dtype=torch.int32, device=device)
    for out, ref, causal in _run(driver, layers, fb, gen, fb.extend_causal_limit):
        torch.testing.assert_close(out, ref, **tolerance(torch.float32))
        assert not torch.allclose(ref, causal)  # the limits matter


def _run(driver: PoolDriver, layers: list[RadixAttention], fb, gen: torch.Generator,
         limits: torch.Tensor | None) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's output, the reference's with the limits, and the causal reference's."""
    driver.backend.init_forward_metadata(fb)
    results = []
    for layer in layers:
        q, k, v = (torch.randn(fb.num_tokens, heads * HEAD_DIM, generator=gen).to(
            fb.input_ids.device) for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
        out = layer(q, k, v, fb)
        k_buf, v_buf = driver.kv_pool.kv_buffers(layer.layer_id)
        refs = [extend_attention_reference(
            q.view(-1, NUM_HEADS, HEAD_DIM), k.view(-1, NUM_KV_HEADS, HEAD_DIM),
            v.view(-1, NUM_KV_HEADS, HEAD_DIM), k_buf, v_buf, driver.req_pool.req_to_token,
            fb.req_pool_indices, fb.extend_prefix_lens, fb.extend_seq_lens, layer.scaling,
            sliding_window=layer.sliding_window or -1, logit_cap=layer.logit_cap,
            causal_limit=limit) for limit in (limits, None)]
        results.append((out.view(-1, NUM_HEADS, HEAD_DIM), *refs))
    return results
