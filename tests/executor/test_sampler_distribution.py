"""Empirical distributions of the Sampler against a plain-Python reference of the filters.

The reference follows the documented semantics: softmax(logits / T), keep the top_k most likely,
keep the smallest most-likely prefix whose renormalised mass reaches top_p, keep tokens with
p >= min_p * p_max, renormalise. Many rows of one request are sampled at once (deterministic
seeds) and compared with a chi-square statistic.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.executor.sampler import Sampler
from radixserve.executor.sampling_info import SamplingBatchInfo

LOGITS = [2.0, 1.5, 1.1, 0.7, 0.3, 0.0, -0.4, -1.0, -1.7, -2.5]
NUM_SAMPLES = 40_000


def make_req(**params: Any) -> Req:
    sampling_params = SamplingParams(**params)
    sampling_params.verify()
    sampling_params.normalize()
    return Req("r", [1], sampling_params)


def reference_distribution(logits: list[float], temperature: float = 1.0, top_k: int = -1,
                           top_p: float = 1.0, min_p: float = 0.0) -> list[float]:
    weights = [math.exp(x / temperature) for x in logits]
    total = sum(weights)
    probs = [w / total for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k > 0 else order
    kept_mass = sum(probs[i] for i in kept)
    prefix, mass_before = [], 0.0
    for i in kept:
        if mass_before >= top_p * kept_mass:
            break
        prefix.append(i)
        mass_before += probs[i]
    p_max = probs[order[0]]
    final = [i for i in prefix if probs[i] >= min_p * p_max]
    final_mass = sum(probs[i] for i in final)
    return [probs[i] / final_mass if i in final else 0.0 for i in range(len(probs))]


def chi_square_bound(dof: int, z: float = 4.75) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at about 1 - 1e-6."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def assert_matches(counts: torch.Tensor, expected: list[float]) -> None:
    total = int(counts.sum())
    statistic, dof = 0.0, -1
    for count, p in zip(counts.tolist(), expected):
        if p == 0.0:
            assert count == 0, f"a filtered-out token was sampled: {counts.tolist()} {expected}"
            continue
        statistic += (count - total * p) ** 2 / (total * p)
        dof += 1
    if dof > 0:
        assert statistic < chi_square_bound(dof), (statistic, counts.tolist(), expected)
    else:
        assert counts[expected.index(1.0)] == total


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.7),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, top_p=0.55),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.8, top_k=6, top_p=0.75),
    dict(temperature=1.2, top_k=5, top_p=0.9, min_p=0.15),
]


@pytest.mark.parametrize("params", CASES)
def test_unseeded_distribution_matches_reference(params: dict[str, Any]) -> None:
    torch.manual_seed(1000)
    vocab = len(LOGITS)
    info = SamplingBatchInfo.from_reqs([make_req(**params)] * NUM_SAMPLES, vocab, "cpu")
    tokens = Sampler().forward(torch.tensor([LOGITS]).expand(NUM_SAMPLES, vocab), info)
    counts = torch.bincount(tokens, minlength=vocab)
    assert_matches(counts, reference_distribution(LOGITS, **params))


@pytest.mark.parametrize("params", [CASES[1], CASES[7]])
def test_seeded_distribution_over_many_seeds_matches_reference(params: dict[str, Any]) -> None:
    vocab, num = len(LOGITS), 4_000
    reqs = [make_req(seed=seed, **params) for seed in range(num)]
    info = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
    tokens = Sampler().forward(torch.tensor([LOGITS]).expand(num, vocab), info)
    assert_matches(torch.bincount(tokens, minlength=vocab),
                   reference_distribution(LOGITS, **params))


def test_mixed_batch_rows_each_follow_their_own_params() -> None:
    torch.manual_seed(7)
    vocab, per = len(LOGITS), 20_000
    reqs = [make_req(temperature=1.0, top_k=2)] * per + [make_req(temperature=0.0)] * 100 \
        + [make_req(temperature=1.0)] * per
    info = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
    tokens = Sampler().forward(torch.tensor([LOGITS]).expand(len(reqs), vocab), info)
    assert_matches(torch.bincount(tokens[:per], minlength=vocab),
                   reference_distribution(LOGITS, top_k=2))
    assert torch.all(tokens[per:per + 100] == 0)
    assert_matches(torch.bincount(tokens[per + 100:], minlength=vocab),
                   reference_distribution(LOGITS))


def test_chi_square_check_can_fail() -> None:
    torch.manual_seed(1000)
    vocab = len(LOGITS)
    info = SamplingBatchInfo.from_reqs([make_req(temperature=1.0)] * NUM_SAMPLES, vocab, "cpu")
    tokens = Sampler().forward(torch.tensor([LOGITS]).expand(NUM_SAMPLES, vocab), info)
    with pytest.raises(AssertionError):
        assert_matches(torch.bincount(tokens, minlength=vocab),
                       reference_distribution(LOGITS, temperature=0.9))


def test_rows_with_different_top_k_share_the_partial_sort() -> None:
    torch.manual_seed(11)
    vocab, per = len(LOGITS), 15_000
    groups = [dict(temperature=1.0, top_k=3), dict(temperature=0.9, top_k=7, top_p=0.8),
              dict(temperature=1.1, top_k=5, min_p=0.3)]
    reqs = [make_req(**params) for params in groups for _ in range(per)]
    info = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
    assert info.max_top_k == 7  # only the 7 most likely are ever sorted
    tokens = Sampler().forward(torch.tensor([LOGITS]).expand(len(reqs), vocab), info)
    for i, params in enumerate(groups):
        assert_matches(torch.bincount(tokens[i * per:(i + 1) * per], minlength=vocab),
                       reference_distribution(LOGITS, **params))
