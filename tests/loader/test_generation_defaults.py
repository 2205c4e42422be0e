"""A model's default sampling parameters: generation_config.json of an HF folder (do_sample
false means greedy), greedy for the bundled Q4_1 SmolLM2, none otherwise; requests that leave a
field unset get them, fields set win."""
from __future__ import annotations

import json

import radixserve
from radixserve.loader.generation_defaults import generation_defaults
from radixserve.loader.model_resolution import ResolvedModel, resolve_model_path
from tests.models.tiny_checkpoints import make_checkpoint


def test_defaults_come_from_generation_config(tmp_path) -> None:
    folder = ResolvedModel("m", str(tmp_path), "hf")
    assert generation_defaults(folder) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "max_length": 9,
         "repetition_penalty": True}))
    assert generation_defaults(folder) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "do_sample": False, "repetition_penalty": 1.1}))
    assert generation_defaults(folder) == {"temperature": 0.0, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text("not json")
    assert generation_defaults(folder) == {}
    assert generation_defaults(resolve_model_path(None)) == {"temperature": 0.0}


def test_engine_requests_take_the_defaults_unless_set(tmp_path) -> None:
    make_checkpoint("llama_tied_mha", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=512)
    prompt = list(range(3, 20))
    greedy = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8,
                                                                "temperature": 0})
    unset = [engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8})
             for _ in range(2)]
    assert unset[0]["output_ids"] == unset[1]["output_ids"] == greedy["output_ids"]
    hot = [engine.generate(input_ids=prompt, sampling_params={
        "max_new_tokens": 8, "temperature": 5.0, "seed": s})["output_ids"] for s in range(3)]
    assert any(h != greedy["output_ids"] for h in hot)  # a field set wins


def test_tokenizer_does_not_warn_about_long_prompts(caplog) -> None:
    """Validation reports prompts over the context; transformers' own warning would be noise."""
    import logging

    from radixserve.loader.tokenizer import get_tokenizer
    tokenizer = get_tokenizer(None)
    with caplog.at_level(logging.WARNING):
        ids = tokenizer.encode("word " * 20_000)
    assert len(ids) > 10_000 and not caplog.records
