from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench_helpers import WORDS, tiny_tokenizer
from radixserve.bench.cli_support import BenchError
from radixserve.bench.datasets import (DEFAULT_TOKEN_RANGE, TokenSampler, attach_prompt_text,
                                       load_conversations, sample_random_requests,
                                       sample_shared_prefix_requests, sample_sharegpt_requests,
                                       uniform_lengths)


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 300), ratio=st.floats(0.0, 1.0), seed=st.integers(0, 2**31))
def test_uniform_lengths_stay_in_range(length: int, ratio: float, seed: int) -> None:
    lens = uniform_lengths(np.random.default_rng(seed), length, ratio, 50)
    low = max(1, int(length * ratio))
    assert all(low <= n <= length for n in lens)


def test_uniform_lengths_reach_both_ends() -> None:
    lens = uniform_lengths(np.random.default_rng(0), 10, 0.5, 2000)
    assert set(lens) == {5, 6, 7, 8, 9, 10}


def test_random_requests_have_exact_lengths() -> None:
    reqs = sample_random_requests(64, input_len=40, output_len=12, range_ratio=0.25, seed=3)
    assert len(reqs) == 64
    for r in reqs:
        assert r.prompt_ids is not None and len(r.prompt_ids) == r.prompt_len
        assert 10 <= r.prompt_len <= 40 and 3 <= r.output_len <= 12
        lo, hi = DEFAULT_TOKEN_RANGE
        assert all(lo <= t < hi for t in r.prompt_ids)
    assert len({r.prompt_len for r in reqs}) > 5  # lengths really vary


def test_random_requests_ratio_one_is_fixed_and_seeded() -> None:
    a = sample_random_requests(8, 16, 4, 1.0, seed=11)
    b = sample_random_requests(8, 16, 4, 1.0, seed=11)
    c = sample_random_requests(8, 16, 4, 1.0, seed=12)
    assert [(r.prompt_len, r.output_len) for r in a] == [(16, 4)] * 8
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]


def test_token_sampler_avoids_special_tokens() -> None:
    tok = tiny_tokenizer()
    sampler = TokenSampler(tok)
    ids = sampler.sample(np.random.default_rng(0), 5000)
    assert set(ids) <= set(range(3, len(tok)))
    assert len(set(ids)) > 150


def test_shared_prefix_structure() -> None:
    groups, per_group, sys_len, q_len = 3, 4, 50, 7
    reqs = sample_shared_prefix_requests(groups, per_group, sys_len, q_len, output_len=5, seed=2)
    assert len(reqs) == groups * per_group
    for g in range(groups):
        members = [r for r in reqs if r.group == g]
        assert len(members) == per_group
        prefix = members[0].prompt_ids[:sys_len]
        for r in members:
            assert r.prompt_len == len(r.prompt_ids) == sys_len + q_len and r.output_len == 5
            assert r.prompt_ids[:sys_len] == prefix
        assert len({tuple(r.prompt_ids[sys_len:]) for r in members}) == per_group
    prefixes = {tuple(r.prompt_ids[:sys_len]) for r in reqs}
    assert len(prefixes) == groups
    # emitted group after group unless shuffled; shuffling keeps the same set
    assert [r.group for r in reqs] == sorted(r.group for r in reqs)
    shuffled = sample_shared_prefix_requests(groups, per_group, sys_len, q_len, 5, 2, shuffle=True)
    assert sorted(map(tuple, (r.prompt_ids for r in shuffled))) == \
        sorted(map(tuple, (r.prompt_ids for r in reqs)))


def _conversation(prompt_words: int, reply_words: int, layout: str = "sharegpt") -> dict:
    prompt = " ".join(WORDS[:prompt_words])
    reply = " ".join(WORDS[:reply_words])
    if layout == "sharegpt":
        return {"conversations": [{"from": "human", "value": prompt},
                                  {"from": "gpt", "value": reply}]}
    return {"messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": prompt},
                         {"role": "assistant", "content": reply}]}


@pytest.mark.parametrize("suffix", ["json", "jsonl"])
def test_sharegpt_lengths_come_from_the_tokenizer(tmp_path: Path, suffix: str) -> None:
    entries = [_conversation(5, 9), _conversation(12, 6, "chat"), _conversation(2, 9),
               _conversation(8, 3), {"conversations": [{"from": "human", "value": "w1"}]},
               _conversation(30, 50)]
    path = tmp_path / f"data.{suffix}"
    if suffix == "json":
        path.write_text(json.dumps(entries))
    else:
        path.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    tok = tiny_tokenizer()
    reqs = sample_sharegpt_requests(str(path), 10, tok, seed=0, max_prompt_len=20,
                                    max_total_len=70)
    # kept: (5, 9) and (12, 6); too short prompt, too short reply, single turn, too long dropped
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(5, 9), (12, 6)]
    for r in reqs:
        assert r.prompt_ids is None
        assert len(tok.encode(r.prompt_text, add_special_tokens=False)) == r.prompt_len
    fixed = sample_sharegpt_requests(str(path), 10, tok, fixed_output_len=2, max_prompt_len=20,
                                     max_total_len=70)
    assert sorted((r.prompt_len, r.output_len) for r in fixed) == [(5, 2), (8, 2), (12, 2)]


def test_attach_prompt_text_decodes_ids() -> None:
    tok = tiny_tokenizer()
    reqs = sample_random_requests(4, 6, 2, seed=0, token_sampler=TokenSampler(tok))
    attach_prompt_text(reqs, tok)
    for r in reqs:
        assert tok.encode(r.prompt_text, add_special_tokens=False) == r.prompt_ids


@pytest.mark.parametrize("text,message", [
    ('{"conversations": []}\n\n{oops\n', "line 3: not valid JSON"),
    ('[{"conversations": []},\n', "not valid JSON"),
    ('[1, 2]', "not a list of conversation objects"),
    ('"just a string"\n', "not a list of conversation objects")])
def test_malformed_conversation_files_are_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "conv.json"
    path.write_text(text)
    with pytest.raises(BenchError, match=f"^{re.escape(str(path))}:? {message}"):
        load_conversations(str(path))


def test_tokenizer_takes_what_the_servers_tokenizer_path_takes(tmp_path) -> None:
    """--tokenizer: a folder of tokenizer files alone (no model), or an error naming the flag
    for a folder that is neither tokenizer nor model."""
    from radixserve.bench.datasets import load_tokenizer
    from radixserve.loader.tokenizer import get_tokenizer

    get_tokenizer("SmolLM2-135M-Instruct").save_pretrained(tmp_path / "tok")
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    assert tokenizer is not None and tokenizer.encode("Hello world")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--tokenizer "):
        load_tokenizer(str(tmp_path / "empty"))
