"""logit_bias (OpenAI semantics): the bias is added to the token's logit before sampling, for
greedy and sampled rows, carried through filter/advance like the penalties; bad values are
refused with a message."""
from __future__ import annotations

import pytest
import torch

from radixserve.core.req import Req
from radixserve.core.request_validation import RequestLimits, validate_request
from radixserve.core.sampling_params import InvalidRequestError, SamplingParams
from radixserve.executor.sampler import Sampler
from radixserve.executor.sampling_info import SamplingBatchInfo

VOCAB = 32


def _req(**params) -> Req:
    sp = SamplingParams(max_new_tokens=4, **params)
    sp.verify()
    sp.normalize()
    return Req("r", [1, 2, 3], sp)


def test_bias_moves_greedy_and_sampled_choices() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0  # the unbiased argmax
    reqs = [_req(temperature=0, logit_bias={"11": 100}), _req(temperature=0),
            _req(temperature=1.0, logit_bias={7: -100, 9: 100})]
    info = SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu")
    ids = Sampler()(logits, info).tolist()
    assert ids == [11, 7, 9]
    kept = info.filter([2, 0])  # the next overlapped step without the middle request
    kept.advance(torch.tensor([9, 11]))
    assert Sampler()(logits[:2], kept).tolist() == [9, 11]


@pytest.mark.parametrize("bias, message", [
    ({"x": 1}, "keys must be token ids"),
    ({"-1": 1}, "keys must be token ids"),
    ({"\u00b2": 1}, "keys must be token ids"),  # "²": str.isdigit() but not a decimal
    ({"\u0661\u0662": 1}, "keys must be token ids"),  # Arabic-Indic "12"
    ({"3": 101}, "in \\[-100, 100\\]"),
    ({"3": "high"}, "in \\[-100, 100\\]"),
    ([1, 2], "must map token ids"),
    ({str(VOCAB): 1}, "token ids in \\[0, 32\\)"),
])
def test_bad_bias_is_refused(bias, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as refused:
        validate_request([1, 2], SamplingParams(max_new_tokens=2, logit_bias=bias),
                         RequestLimits(context_len=64, vocab_size=VOCAB))
    assert refused.value.param == "logit_bias"
