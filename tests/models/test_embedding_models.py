"""Embedding models (--is-embedding) through the Engine against transformers, fp32: each
input's vector is the last token's final hidden state, L2-normalised, for headless checkpoints
(Qwen3Model as Qwen3-Embedding saves it, MistralModel as e5-mistral's) and for one with an LM
head (which is left out); with chunked prefill and the radix cache; and what is refused."""
from __future__ import annotations

import pytest
import torch
import transformers

import radixserve

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
CHECKPOINTS = {
    "qwen3_headless": (transformers.Qwen3Config, dict(SMALL, head_dim=16), transformers.AutoModel),
    "mistral_headless": (transformers.MistralConfig, SMALL, transformers.AutoModel),
    "qwen2_with_head": (transformers.Qwen2Config, SMALL, transformers.AutoModelForCausalLM),
}


def save(name: str, folder) -> torch.nn.Module:
    config_cls, kwargs, auto = CHECKPOINTS[name]
    torch.manual_seed(0)
    model = auto.from_config(config_cls(**kwargs))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.1)
    model.save_pretrained(folder)
    return getattr(model, "model", model)  # the decoder (a CausalLM's inner model)


def reference(decoder: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = decoder(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_vectors_equal_transformers(name: str, tmp_path) -> None:
    decoder = save(name, tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (1, 7, 90)]
    prompts.append(prompts[2][:60] + [3, 4, 5])  # shares a cached prefix with the third
    engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                               is_embedding=True, max_total_tokens=2000, chunked_prefill_size=32)
    try:
        first = engine.encode(input_ids=prompts[:3])
        again = engine.encode(input_ids=prompts[2:])
        with pytest.raises(Exception, match="embedding model generates no tokens"):
            engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2})
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    for out, ids in zip(first + again[1:], prompts):
        vector = torch.tensor(out["embedding"])
        assert vector.shape == (64,)
        torch.testing.assert_close(vector, reference(decoder, ids), atol=2e-5, rtol=1e-4)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert again[0]["embedding"] == pytest.approx(first[2]["embedding"], abs=1e-6)
    assert again[0]["meta_info"]["cached_tokens"] >= 64  # the whole prompt but its last chunk
    assert again[1]["meta_info"]["cached_tokens"] >= 32


def test_what_is_refused(tmp_path) -> None:
    save("qwen3_headless", tmp_path)
    with pytest.raises(ValueError, match="--is-embedding"):  # a headless checkpoint, no flag
        radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="embedding model"):
        radixserve.Engine(str(tmp_path), skip_tokenizer_init=True, is_embedding=True,
                          speculative_algorithm="ngram")
    import json
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    with pytest.raises(ValueError, match="bidirectional"):  # gte-style configs
        radixserve.Engine(str(tmp_path), skip_tokenizer_init=True, is_embedding=True)
