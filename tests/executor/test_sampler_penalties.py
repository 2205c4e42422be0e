"""Penalties and min_new_tokens against a straightforward per-row Python reference."""
from __future__ import annotations

import math
import random
from typing import Any

import torch

from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.executor.penalties import BatchPenalties
from radixserve.executor.sampler import Sampler
from radixserve.executor.sampling_info import SamplingBatchInfo

VOCAB = 32
EOS = {2, 3}


def make_req(prompt: list[int], output: list[int], **params: Any) -> Req:
    sampling_params = SamplingParams(max_new_tokens=64, **params)
    sampling_params.verify()
    sampling_params.normalize()
    req = Req("r", prompt, sampling_params)
    req.output_ids = list(output)
    return req


def reference_penalised_row(logits: list[float], req: Req, eos_ids: set[int]) -> list[float]:
    params = req.sampling_params
    out = list(logits)
    for token, bias in (params.logit_bias or {}).items():  # before the penalties, as vLLM V1
        out[token] += bias
    for token in set(req.origin_input_ids + req.output_ids):
        if out[token] > 0:
            out[token] /= params.repetition_penalty
        else:
            out[token] *= params.repetition_penalty
    for token in set(req.output_ids):
        count = req.output_ids.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    if len(req.output_ids) < params.min_new_tokens:
        stops = set(params.stop_token_ids or []) | (set() if params.ignore_eos else eos_ids)
        for token in stops:
            out[token] = -math.inf
    return out


def random_reqs(rng: random.Random, bs: int) -> list[Req]:
    reqs = []
    for i in range(bs):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 15))]
        params: dict[str, Any] = dict(temperature=rng.choice([0.0, 0.7, 1.0]))
        if i % 4 != 3:  # every fourth request uses no penalty at all
            params.update(frequency_penalty=rng.uniform(-2, 2), presence_penalty=rng.uniform(-2, 2),
                          repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
                          min_new_tokens=rng.choice([0, 5, 10]),
                          stop_token_ids=rng.choice([None, [7], [8, 9]]),
                          ignore_eos=rng.random() < 0.3,
                          # a bias that flips a seen token's sign changes its repetition
                          logit_bias=rng.choice([None, {str(t): rng.uniform(-8, 8)
                                                        for t in rng.sample(range(VOCAB), 6)}]))
        reqs.append(make_req(prompt, output, **params))
    return reqs


def test_penalties_match_python_reference() -> None:
    rng = random.Random(0)
    for trial in range(20):
        reqs = random_reqs(rng, bs=8)
        gen = torch.Generator().manual_seed(trial)
        logits = torch.randn(len(reqs), VOCAB, generator=gen) * 4
        penalties = BatchPenalties.build(reqs, VOCAB, "cpu", EOS)
        got = penalties.apply(logits)
        expected = torch.tensor([reference_penalised_row(row, req, EOS)
                                 for row, req in zip(logits.tolist(), reqs)])
        assert torch.equal(torch.isinf(got), torch.isinf(expected))
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_each_penalty_kind_alone_changes_only_its_tokens() -> None:
    logits = torch.linspace(-3, 3, VOCAB).unsqueeze(0)
    prompt, output = [1, 5], [5, 6, 6, 31]
    cases = [dict(frequency_penalty=0.5), dict(presence_penalty=-1.0),
             dict(repetition_penalty=1.8), dict(min_new_tokens=9, stop_token_ids=[0])]
    for params in cases:
        req = make_req(prompt, output, **params)
        got = BatchPenalties.build([req], VOCAB, "cpu", EOS).apply(logits)[0].tolist()
        expected = reference_penalised_row(logits[0].tolist(), req, EOS)
        changed = {i for i in range(VOCAB) if got[i] != logits[0, i].item()}
        assert changed, params
        assert changed == {i for i in range(VOCAB) if expected[i] != logits[0, i].item()}
        assert torch.allclose(torch.tensor(got), torch.tensor(expected))


def test_no_penalty_builds_nothing() -> None:
    reqs = [make_req([1, 2], [3, 4], temperature=0.5), make_req([1], [], min_new_tokens=2)]
    reqs[1].output_ids = [5, 6]  # min_new_tokens already reached
    assert BatchPenalties.build(reqs, VOCAB, "cpu", EOS) is None
    assert SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu", EOS).penalties is None


def test_greedy_with_penalties_is_argmax_of_penalised_logits() -> None:
    rng = random.Random(1)
    reqs = [make_req([1, 2, 3], [3, 3, 4], temperature=0.0, repetition_penalty=2.0,
                     frequency_penalty=1.0) for _ in range(4)] + random_reqs(rng, 4)
    for req in reqs:
        req.sampling_params.temperature, req.sampling_params.top_k = 0.0, 1
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    tokens = Sampler().forward(logits, SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu", EOS))
    for row, req in enumerate(reqs):
        expected = reference_penalised_row(logits[row].tolist(), req, EOS)
        assert tokens[row] == max(range(VOCAB), key=lambda i: expected[i])


def test_min_new_tokens_blocks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 50.0  # EOS overwhelmingly likely
    logits[0, 7] = 40.0  # then a stop token
    sampler = Sampler()
    for sampled_params in (dict(temperature=0.0), dict(temperature=1.0, seed=1)):
        for output_len in range(6):
            req = make_req([1], [10] * output_len, min_new_tokens=4, stop_token_ids=[7],
                           **sampled_params)
            token = int(sampler.forward(logits, SamplingBatchInfo.from_reqs([req], VOCAB,
                                                                           "cpu", EOS))[0])
            if output_len < 4:
                assert token not in (2, 3, 7)
            else:
                assert token == 2


def test_min_new_tokens_leaves_eos_alone_when_ignore_eos() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 50.0
    req = make_req([1], [], min_new_tokens=4, stop_token_ids=[7], ignore_eos=True,
                   temperature=0.0)
    info = SamplingBatchInfo.from_reqs([req], VOCAB, "cpu", EOS)
    assert int(Sampler().forward(logits, info)[0]) == 2  # EOS does not stop this request


def test_min_new_tokens_mask_expires_after_advance() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 50.0
    req = make_req([1], [], min_new_tokens=2, temperature=0.0)
    info = SamplingBatchInfo.from_reqs([req], VOCAB, "cpu", EOS)
    sampler = Sampler()
    tokens = []
    for _ in range(3):
        token = sampler.forward(logits, info)
        tokens.append(int(token[0]))
        info.advance(token)
    assert tokens[0] != 3 and tokens[1] != 3 and tokens[2] == 3


def _info_state(info: SamplingBatchInfo) -> dict[str, Any]:
    """What a sampling info decides with besides its penalty tables, on the host."""
    state: dict[str, Any] = {
        name: getattr(info, name).tolist()
        for name in ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask")}
    state.update(is_all_greedy=info.is_all_greedy, has_greedy=info.has_greedy,
                 seeds=list(zip(info.seed_rows, info.seeds, info.seed_steps)),
                 greedy_rows=sorted(info.greedy_rows))
    return state


def test_filter_then_advance_equals_a_fresh_build() -> None:
    """What the overlap path carries from one decode step to the next (keep some rows, account
    for the token each sampled) is what building the info anew from the requests gives."""
    rng = random.Random(5)
    reqs = random_reqs(rng, 7)
    for i, req in enumerate(reqs):
        if i % 3 == 0:  # seeded rows, to follow their step counters through filter/advance
            req.sampling_params.seed = 100 + i
    info = SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu", EOS)
    keep = [5, 0, 3, 6]
    sampled = torch.tensor([rng.randrange(VOCAB) for _ in reqs])
    carried = info.filter(keep)
    carried.advance(sampled[keep])
    for i in keep:
        reqs[i].output_ids.append(int(sampled[i]))
    fresh = SamplingBatchInfo.from_reqs([reqs[i] for i in keep], VOCAB, "cpu", EOS)
    assert _info_state(carried) == _info_state(fresh)
    # penalty tables may differ where they do not act (a fresh build counts tokens only for
    # rows that use a penalty); the penalised logits must not
    assert carried.penalties is not None and fresh.penalties is not None
    for _ in range(3):
        logits = torch.randn(len(keep), VOCAB) * 3
        torch.testing.assert_close(carried.penalties.apply(logits), fresh.penalties.apply(logits))


def _joined_and_fresh(kept: list[Req], joining: list[Req]
                      ) -> tuple[SamplingBatchInfo, SamplingBatchInfo]:
    joined = SamplingBatchInfo.from_reqs(kept, VOCAB, "cpu", EOS).concat(
        SamplingBatchInfo.from_reqs(joining, VOCAB, "cpu", EOS))
    return joined, SamplingBatchInfo.from_reqs(kept + joining, VOCAB, "cpu", EOS)


def test_concat_equals_a_fresh_build_of_the_joined_batch() -> None:
    """Requests joining a decode batch in flight: the carried rows' info, then the joining
    rows' info, decide as one info built from all the requests (penalties used by one side
    only get neutral rows on the other; seeds keep their rows and steps)."""
    rng = random.Random(11)
    for trial in range(6):
        reqs = random_reqs(rng, 9)
        for i, req in enumerate(reqs):
            if i % 3 == 1:
                req.sampling_params.seed = 40 + i
            if trial % 2 and i == 2:
                req.sampling_params.logit_bias = {5: 3.0, 6: -2.0}
            if i == 4:
                req.sampling_params.top_k = 3
        split = [0, 3, 5, 9, 4, 7][trial]
        if trial == 3:  # no penalties at all on the joining side
            reqs = reqs[:split] + [make_req([1, 2], [3], temperature=0.8)]
        joined, fresh = _joined_and_fresh(reqs[:split], reqs[split:])
        assert _info_state(joined) == _info_state(fresh)
        assert (joined.need_top_k, joined.need_top_p, joined.need_min_p) == \
            (fresh.need_top_k, fresh.need_top_p, fresh.need_min_p)
        assert joined.max_top_k == fresh.max_top_k
        assert (joined.penalties is None) == (fresh.penalties is None)
        logits = torch.randn(len(reqs), VOCAB) * 3
        if fresh.penalties is not None:
            assert joined.penalties is not None
            torch.testing.assert_close(joined.penalties.apply(logits),
                                       fresh.penalties.apply(logits))
        sampled = []
        for info in (joined, fresh):
            torch.manual_seed(trial)  # the unseeded rows' noise
            sampled.append(Sampler().forward(logits, info))
        torch.testing.assert_close(*sampled)


def test_concat_of_greedy_batches_stays_greedy() -> None:
    kept = [make_req([1], [2], temperature=0.0) for _ in range(2)]
    joining = [make_req([3], [], temperature=0.0)]
    joined, fresh = _joined_and_fresh(kept, joining)
    assert joined.is_all_greedy and joined.penalties is None
    assert _info_state(joined) == _info_state(fresh)


def test_a_grammar_that_must_end_wins_over_min_new_tokens() -> None:
    # the grammar allows only EOS (its match is complete) while min_new_tokens still masks
    # EOS: no token would be left, and argmax over -inf picks token 0, which the grammar
    # refuses. The grammar's end wins; other rows keep both masks.
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 9.0
    mask = torch.zeros(2, 1, dtype=torch.int32)
    mask[0, 0] = 1 << 2  # row 0: only EOS 2
    mask[1, 0] = (1 << 2) | (1 << 5)  # row 1: EOS 2 or token 5
    for sampled_params in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
        reqs = [make_req([1], [4], min_new_tokens=4, **sampled_params) for _ in range(2)]
        info = SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu", EOS)
        info.vocab_mask = mask
        assert Sampler().forward(logits, info).tolist() == [2, 5]
