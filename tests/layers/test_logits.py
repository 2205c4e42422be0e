"""Last-token logits: into a caller's buffer (the CUDA graph runner's, shared by every captured
size) or a fresh tensor, with Gemma-2's soft cap, the same values either way; the graphs' in the
compute dtype."""
from __future__ import annotations

import pytest
import torch

from radixserve.core.forward_batch import ForwardBatch, ForwardMode
from radixserve.layers.embedding import ParallelLMHead
from radixserve.layers.linear import linear, linear_into
from radixserve.layers.logits import compute_logits

VOCAB, HIDDEN = 50, 16


def decode_batch(bs: int, logits_out: torch.Tensor | None,
                 in_model_dtype: bool = False) -> ForwardBatch:
    zeros = torch.zeros(bs, dtype=torch.int64)
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=zeros,
                        positions=zeros, req_pool_indices=zeros, seq_lens=zeros + 1,
                        out_cache_loc=zeros, seq_lens_sum=bs, seq_lens_cpu=[1] * bs,
                        attn_backend=None, logits_out=logits_out,
                        logits_in_model_dtype=in_model_dtype)


@pytest.mark.parametrize("cap", [0.0, 3.0])
def test_decode_logits_go_into_the_given_buffer(cap: float) -> None:
    torch.manual_seed(0)
    head = ParallelLMHead(VOCAB, HIDDEN)
    head.weight.data.copy_(torch.randn(VOCAB, HIDDEN))
    hidden = torch.randn(5, HIDDEN, dtype=torch.bfloat16)
    head.weight.data = head.weight.data.to(torch.bfloat16)
    reference = (hidden.float() @ head.weight.float().t())
    if cap > 0:
        reference = torch.tanh(reference / cap) * cap
    buffer = torch.full((8, VOCAB), float("nan"))
    into = compute_logits(hidden, head, decode_batch(5, buffer), cap).next_token_logits
    fresh = compute_logits(hidden, head, decode_batch(5, None), cap).next_token_logits
    assert into.data_ptr() == buffer.data_ptr() and into.shape == (5, VOCAB)
    assert into.dtype == fresh.dtype == torch.float32
    assert torch.equal(into, fresh)
    torch.testing.assert_close(into, reference, atol=0.05, rtol=0.02)
    assert torch.isnan(buffer[5:]).all()  # rows past the batch untouched
    if cap > 0:
        assert into.abs().max() < cap


@pytest.mark.parametrize("cap", [0.0, 3.0])
def test_graph_logits_stay_in_the_compute_dtype_unless_capped(cap: float) -> None:
    """The CUDA graphs' decode logits (logits_in_model_dtype): bf16, the same values the float32
    path holds (its cast is exact), written into a bf16 buffer; under a soft cap float32."""
    torch.manual_seed(0)
    head = ParallelLMHead(VOCAB, HIDDEN)
    head.weight.data = torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)
    hidden = torch.randn(5, HIDDEN, dtype=torch.bfloat16)
    as_float = compute_logits(hidden, head, decode_batch(5, None), cap).next_token_logits
    kept = compute_logits(hidden, head, decode_batch(5, None, True), cap).next_token_logits
    expected_dtype = torch.float32 if cap > 0 else torch.bfloat16
    assert kept.dtype == expected_dtype
    assert torch.equal(kept.float(), as_float)
    buffer = torch.full((8, VOCAB), float("nan"), dtype=expected_dtype)
    into = compute_logits(hidden, head, decode_batch(5, buffer, True), cap).next_token_logits
    assert into.data_ptr() == buffer.data_ptr() and into.shape == (5, VOCAB)
    assert torch.equal(into.float(), as_float)
    assert torch.equal(into.argmax(-1), as_float.argmax(-1))
    assert torch.isnan(buffer[5:].float()).all()


def test_linear_into_writes_the_product_into_the_rows_given() -> None:
    torch.manual_seed(1)
    x = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16)
    buffer = torch.zeros(6, VOCAB, dtype=torch.bfloat16)
    out = linear_into(x, weight, buffer[:3])
    assert out.data_ptr() == buffer.data_ptr()
    assert torch.equal(out, linear(x, weight))
    assert not buffer[3:].any()
