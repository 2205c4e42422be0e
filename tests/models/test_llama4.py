"""Llama-4 (Scout / Maverick layouts) through the Engine against transformers on tiny random
checkpoints it saved itself (tests/models/tiny_checkpoints.py "llama4_scout",
"llama4_multimodal"; fp32): greedy tokens equal transformers' full forward argmax'ed token by
token, with chunked prefill cutting the 8-position attention chunks, a prompt served from the
radix cache and decode steps across chunk boundaries; the released multimodal layout served
text-only; tensor parallelism over gloo (slow). Logits per pass: test_llama_vs_hf.py runs both
tiny layouts. The rope permutation at load: against rope over adjacent pairs as transformers
computes it."""
from __future__ import annotations

import pytest
import torch

import radixserve
from radixserve.core.model_config import ModelConfig
from radixserve.layers.quantization.fp8 import FP8_DTYPE
from radixserve.loader.model_source import load_model_source
from radixserve.layers.rope_pairs import pairs_to_halves
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.tiny_checkpoints import make_checkpoint

NEW_TOKENS = 40
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (61, 90)]
    # the first prompt's first 50 tokens again: served from the radix cache
    prompts.append(prompts[0][:50] + torch.randint(0, vocab, (21,), generator=gen).tolist())
    return prompts


def _engine_equals_transformers(hf_model, folder, tp_size: int = 1) -> None:
    prompts = _prompts(160)
    expected = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]
    engine = radixserve.Engine(str(folder), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=4096, chunked_prefill_size=20,
                               tp_size=tp_size)
    try:
        first = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
        rest = engine.generate(input_ids=prompts[1:], sampling_params=GREEDY)
        assert [first["output_ids"]] + [r["output_ids"] for r in rest] == expected
        assert rest[1]["meta_info"]["cached_tokens"] >= 40
        state = engine.get_internal_state()
        assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    finally:
        engine.shutdown()


def test_scout_layout_generates_as_transformers(tmp_path) -> None:
    _engine_equals_transformers(make_checkpoint("llama4_scout", tmp_path), tmp_path)


def test_released_multimodal_layout_serves_its_language_model(tmp_path) -> None:
    hf_model = make_checkpoint("llama4_multimodal", tmp_path)
    config: ModelConfig = load_model_source(str(tmp_path), "auto").model_config
    assert config.architecture == "Llama4ForConditionalGeneration"
    assert config.hf.attention_chunk_size == 8 and config.num_hidden_layers == 4
    _engine_equals_transformers(hf_model, tmp_path)


@pytest.mark.slow  # ~15 s: two gloo ranks
def test_tp2_generates_as_transformers(tmp_path) -> None:
    """Heads, experts and the shared expert split over two ranks (q/k permuted per head
    before the split)."""
    _engine_equals_transformers(make_checkpoint("llama4_scout", tmp_path), tmp_path,
                                tp_size=2)


def _rope_pairs(x: torch.Tensor, positions: torch.Tensor, head_dim: int) -> torch.Tensor:
    """transformers' Llama-4 rope: each adjacent pair (x[2i], x[2i+1]) a complex number
    rotated by position * theta^(-2i / D)."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.polar(torch.ones(len(positions), head_dim // 2),
                         positions[:, None].float() * freqs)
    pairs = torch.view_as_complex(x.float().reshape(len(positions), -1, head_dim // 2, 2))
    return torch.view_as_real(pairs * angles[:, None]).flatten(2)


def _rope_halves(x: torch.Tensor, positions: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rope over halves (x[i], x[i + D/2]), the layout this runtime's kernels take."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None].float() * freqs
    cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
    x = x.float().reshape(len(positions), -1, head_dim)
    rotated = torch.cat((-x[..., head_dim // 2:], x[..., :head_dim // 2]), dim=-1)
    return x * cos + rotated * sin


def test_pair_rotation_becomes_halves_rotation_with_permuted_rows() -> None:
    """q = W x with W's rows permuted per head, rotated over halves, is the pair rotation of
    the original q, permuted the same way: scores between such q and k are unchanged."""
    head_dim, heads, tokens = 16, 3, 5
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(heads * head_dim, 24, generator=gen)
    x = torch.randn(tokens, 24, generator=gen)
    positions = torch.tensor([0, 1, 7, 100, 3000])
    ours = _rope_halves(x @ pairs_to_halves(weight, head_dim).T, positions, head_dim)
    theirs = _rope_pairs(x @ weight.T, positions, head_dim)
    permuted = pairs_to_halves(theirs.reshape(tokens, -1).T, head_dim).T
    torch.testing.assert_close(ours.reshape(tokens, -1), permuted, atol=1e-4, rtol=1e-4)
    scores_ours = torch.einsum("thd,shd->hts", ours, ours)
    scores_theirs = torch.einsum("thd,shd->hts", theirs, theirs)
    torch.testing.assert_close(scores_ours, scores_theirs, atol=1e-3, rtol=1e-4)


def test_fp8_codes_and_scales_permute_as_their_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 8, generator=gen)
    codes = weight.to(FP8_DTYPE)
    moved = pairs_to_halves(codes, 16)
    assert moved.dtype == FP8_DTYPE
    assert torch.equal(moved.float(), pairs_to_halves(codes.float(), 16))
    assert torch.equal(pairs_to_halves(torch.arange(32.0)[:, None], 16)[:10, 0],
                       torch.tensor([0.0, 2, 4, 6, 8, 10, 12, 14, 1, 3]))
