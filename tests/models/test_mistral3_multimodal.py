"""Mistral Small 3.1 / 3.2 checkpoints (Mistral3ForConditionalGeneration) served text-only,
against transformers' Mistral3ForConditionalGeneration on a tiny random checkpoint it saved
itself (tests/models/tiny_checkpoints.py "mistral3_multimodal", fp32): the language model's
config, its tensors loaded and the vision ones skipped, greedy generation through the Engine
(radix cache, chunked prefill) equal to transformers' full forward argmax'ed token by token."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

import radixserve
from radixserve.config import ModelConfig
from radixserve.loader.model_source import load_model_source
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.tiny_checkpoints import make_checkpoint

NEW_TOKENS = 32


def test_the_language_model_serves_as_transformers_runs_it(tmp_path) -> None:
    hf_model = make_checkpoint("mistral3_multimodal", tmp_path)
    names = list(load_file(str(tmp_path / "model.safetensors")))
    assert any(n.startswith("vision_tower.") for n in names)  # the checkpoint has them
    config: ModelConfig = load_model_source(str(tmp_path), "auto").model_config
    assert config.architecture == "Mistral3ForConditionalGeneration"
    assert (config.hidden_size, config.head_dim, config.num_key_value_heads) == (64, 24, 2)
    vocab = hf_model.config.text_config.vocab_size
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (70, 101)]
    prompts.append(prompts[0][:60] + torch.randint(0, vocab, (20,), generator=gen).tolist())
    expected = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]
    engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=4096, chunked_prefill_size=48)
    try:
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        first = engine.generate(input_ids=prompts[0], sampling_params=params)
        rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
        got = [first["output_ids"]] + [r["output_ids"] for r in rest]
        assert got == expected
        assert rest[1]["meta_info"]["cached_tokens"] >= 48
        state = engine.get_internal_state()
        assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    finally:
        engine.shutdown()
