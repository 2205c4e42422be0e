"""Logprob helpers against torch.log_softmax and torch.topk."""
from __future__ import annotations

import torch

from radixserve.executor.sampler import (compute_input_logprobs, compute_logprobs,
                                         extend_next_token_ids)

VOCAB = 50


def test_chosen_and_top_logprobs_match_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=gen) * 5
    token_ids = torch.randint(0, VOCAB, (6,), generator=gen)
    top_k_nums = [0, 1, 5, 20, 3, 0]
    result = compute_logprobs(logits, token_ids, top_k_nums)
    reference = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(result.token_logprobs, reference[torch.arange(6), token_ids], atol=1e-5)
    for row, k in enumerate(top_k_nums):
        assert len(result.top_logprobs[row]) == k
        if k == 0:
            continue
        values, ids = torch.topk(reference[row], k)
        assert [t for _, t in result.top_logprobs[row]] == ids.tolist()
        got = torch.tensor([v for v, _ in result.top_logprobs[row]])
        assert torch.allclose(got, values, atol=1e-5)


def test_no_top_logprobs_and_bf16_input() -> None:
    logits = (torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)) * 3)
    logits = logits.to(torch.bfloat16)
    token_ids = torch.tensor([0, 7, 49])
    result = compute_logprobs(logits, token_ids, [0, 0, 0])
    assert result.top_logprobs == [[], [], []]
    reference = torch.log_softmax(logits.float(), dim=-1)[torch.arange(3), token_ids]
    assert result.token_logprobs.dtype == torch.float32
    assert torch.allclose(result.token_logprobs, reference, atol=1e-5)


def test_top_k_larger_than_vocab_is_clamped() -> None:
    logits = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
    result = compute_logprobs(logits, torch.tensor([0, 1]), [20, 2])
    assert len(result.top_logprobs[0]) == 4 and len(result.top_logprobs[1]) == 2


def test_extend_next_token_ids_shifts_within_each_request() -> None:
    input_ids = torch.tensor([10, 11, 12, 20, 30, 31])
    lens = [3, 1, 2]
    assert extend_next_token_ids(input_ids, lens).tolist() == [11, 12, 0, 0, 31, 0]
    last = torch.tensor([13, 21, 32])
    assert extend_next_token_ids(input_ids, lens, last).tolist() == [11, 12, 13, 21, 31, 32]


def test_input_logprobs_chunked_equal_log_softmax() -> None:
    gen = torch.Generator().manual_seed(3)
    num_tokens = 37
    logits = torch.randn(num_tokens, VOCAB, generator=gen) * 4
    input_ids = torch.randint(0, VOCAB, (num_tokens,), generator=gen)
    next_ids = extend_next_token_ids(input_ids, [20, 17])
    reference = torch.log_softmax(logits, dim=-1)
    for chunk_rows in (5, 512):
        result = compute_input_logprobs(logits, next_ids, top_k_nums=3, chunk_rows=chunk_rows)
        assert torch.allclose(result.token_logprobs,
                              reference[torch.arange(num_tokens), next_ids], atol=1e-5)
        values, ids = torch.topk(reference, 3, dim=-1)
        assert [[t for _, t in row] for row in result.top_logprobs] == ids.tolist()
        got = torch.tensor([[v for v, _ in row] for row in result.top_logprobs])
        assert torch.allclose(got, values, atol=1e-5)
