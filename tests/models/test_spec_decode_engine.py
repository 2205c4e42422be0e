"""Speculative decoding (n-gram drafts) through the Engine on tiny random checkpoints, fp32:
greedy and seeded sampled outputs equal plain decoding's token for token, logprobs agree,
drafts are really accepted, and no KV slot leaks. Families with other attention layouts
(sliding window, MLA) verify their drafts through their own decode kernels."""
from __future__ import annotations

import pytest
import torch

import radixserve
from tests.models.tiny_checkpoints import make_checkpoint

SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 5,
        "speculative_ngram_min_match_window_size": 1}


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    motif = torch.randint(0, vocab, (9,), generator=gen).tolist()
    return [motif * 6 + motif[:4],  # a prompt that repeats: drafts from the first step on
            torch.randint(0, vocab, (70,), generator=gen).tolist(),
            (motif * 3)[:20] + torch.randint(0, vocab, (30,), generator=gen).tolist()]


def _generate(path: str, prompts: list[list[int]], params: dict, **args) -> tuple[list, dict]:
    engine = radixserve.Engine(path, dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=3000, **args)
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    state = engine.get_internal_state()
    engine.shutdown()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    return outs, state


@pytest.mark.parametrize("name", ["llama_gqa_llama3_rope", "mistral_window32",
                                  "deepseek_v2_lite_mla"])
def test_spec_outputs_equal_plain_decoding(name: str, tmp_path) -> None:
    hf_model = make_checkpoint(name, tmp_path)
    prompts = _prompts(hf_model.config.vocab_size)
    greedy = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    plain, _ = _generate(str(tmp_path), prompts, greedy)
    spec, state = _generate(str(tmp_path), prompts, greedy, **SPEC)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert state["spec_accept_rate"] > 0.1 and state["spec_accept_length"] > 1.2, state
    for a, b in zip(spec, plain):
        got = [entry[0] for entry in a["meta_info"]["output_token_logprobs"]]
        want = [entry[0] for entry in b["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)
    if name == "llama_gqa_llama3_rope":  # seeded sampling draws the same tokens too
        sampled = {"max_new_tokens": 40, "temperature": 0.7, "seed": 5, "ignore_eos": True}
        plain, _ = _generate(str(tmp_path), prompts, sampled)
        spec, _ = _generate(str(tmp_path), prompts, sampled, **SPEC)
        assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
