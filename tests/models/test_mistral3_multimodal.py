"""Mistral Small 3.1 / 3.2 checkpoints (Mistral3ForConditionalGeneration) on text prompts,
against transformers' Mistral3ForConditionalGeneration on a tiny random checkpoint it saved
itself (tests/models/tiny_checkpoints.py "mistral3_multimodal", fp32): the language model's
config, greedy generation through the Engine (radix cache, chunked prefill) equal to
transformers' full forward argmax'ed token by token; Mistral Small 4's decoder under the same
architecture (served text-only). Images: test_mistral3_images.py (the vision tensors are
loaded and checked there), test_mistral3_serving.py."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

import radixserve
from radixserve.core.model_config import ModelConfig
from radixserve.loader.model_source import load_model_source
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.tiny_checkpoints import make_checkpoint

NEW_TOKENS = 32


def test_mistral_small_4_serves_its_mistral4_decoder(tmp_path) -> None:
    """The same architecture around a Mistral-4 decoder (MLA, MoE): the registry picks
    Mistral-4's class by the language model's model_type; greedy equal to transformers."""
    from radixserve.models.registry import model_class
    hf_model = make_checkpoint("mistral4_multimodal", tmp_path)
    config: ModelConfig = load_model_source(str(tmp_path), "auto").model_config
    assert model_class(config).__name__ == "Mistral4ForConditionalGeneration"
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 150, (n,), generator=gen).tolist() for n in (40, 77)]
    expected = [hf_greedy(hf_model, ids, 16) for ids in prompts]
    engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=4096, chunked_prefill_size=48)
    try:
        out = engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert [r["output_ids"] for r in out] == expected
    finally:
        engine.shutdown()


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


# mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json (vision_config abridged): no
# tie_word_embeddings anywhere, where Mistral3Config's own default is True and MistralConfig's
# False; the language model is untied
HUB_SMALL_31 = {
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10,
    "model_type": "mistral3", "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {"head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768,
                    "max_position_embeddings": 131072, "model_type": "mistral",
                    "num_attention_heads": 32, "num_hidden_layers": 40,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                    "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072},
    "torch_dtype": "bfloat16",
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "image_size": 1540, "patch_size": 14},
    "vision_feature_layer": -1,
}


def test_the_hub_config_is_read_as_an_untied_mistral() -> None:
    config = ModelConfig.from_hf_dict(HUB_SMALL_31)
    assert not config.tie_word_embeddings
    assert (config.num_hidden_layers, config.head_dim, config.vocab_size) == (40, 128, 131072)


def test_another_language_model_under_the_architecture_is_refused(tmp_path) -> None:
    import json

    import pytest

    from radixserve.config import ServerArgs
    from radixserve.executor.model_runner import ModelRunner
    ministral = dict(HUB_SMALL_31, text_config=dict(
        HUB_SMALL_31["text_config"], model_type="ministral3", hidden_size=64, head_dim=16,
        intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=160))
    (tmp_path / "config.json").write_text(json.dumps(ministral))
    with pytest.raises(ValueError, match="ministral3"):
        ModelRunner(ServerArgs(model_path=str(tmp_path), load_format="dummy", device="cpu",
                               dtype="float32", max_total_tokens=256))
