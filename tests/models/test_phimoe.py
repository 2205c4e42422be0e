"""PhiMoE (Phi-3.5-MoE) against transformers: the sparsemixer routing, the LongRoPE tables with
a scale per table, and greedy tokens through the Engine on a tiny checkpoint.

transformers' PhiMoE rotates with the short factors at every length (its rotary forward
recomputes the short frequencies and switches only the scale), where Microsoft's modeling code
and vLLM take the long factors past the original context; the long table here is theirs, so
it is checked against the formula, and the Engine against transformers within the original
context."""
from __future__ import annotations

import pytest
import torch
from transformers.models.phimoe.modeling_phimoe import sparsemixer

import radixserve
from radixserve.core.model_config import ModelConfig
from radixserve.layers.moe.router import RoutingConfig, select_experts
from radixserve.layers.rotary import RotaryEmbedding, default_inv_freq
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.tiny_checkpoints import CONFIGS, make_checkpoint


@pytest.mark.parametrize("jitter", [0.01, 0.3, 2.0])
def test_sparsemixer_equals_transformers(jitter: float) -> None:
    """Both experts and both weights, for gaps that mask most, some and no experts."""
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    weights, ids = sparsemixer(logits, jitter_eps=jitter, training=False)
    got = select_experts(logits, RoutingConfig(16, 2, scoring="sparsemixer",
                                               jitter_eps=jitter))
    assert torch.equal(got.ids.long(), ids)
    torch.testing.assert_close(got.weights, weights)
    with pytest.raises(ValueError, match="top 2"):
        RoutingConfig(16, 3, scoring="sparsemixer")


def test_tables_take_each_scale(tmp_path) -> None:
    """The short rows: transformers' cos / sin within the original context; the long rows:
    the long factors' frequencies scaled by long_mscale (the formula)."""
    hf_model = make_checkpoint("phimoe_longrope", tmp_path)
    config = ModelConfig.from_path(str(tmp_path))
    config.context_length = config.max_position_embeddings
    table = RotaryEmbedding.from_config(config)
    positions = torch.arange(256)
    cos, sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(table.cos_cache[:256], cos[0])
    torch.testing.assert_close(table.sin_cache[:256], sin[0])
    rope = CONFIGS["phimoe_longrope"][1]["rope_scaling"]
    inv_freq = default_inv_freq(16, config.rope_parameters["rope_theta"]) / \
        torch.tensor(rope["long_factor"])
    angles = torch.outer(torch.arange(512, dtype=torch.float32), inv_freq).repeat(1, 2)
    torch.testing.assert_close(table.cos_cache[512:], angles.cos() * rope["long_mscale"])
    torch.testing.assert_close(table.sin_cache[512:], angles.sin() * rope["long_mscale"])


def test_greedy_equals_transformers(tmp_path) -> None:
    """Two prompts chunked in 48s, a third sharing the first one's opening through the radix
    cache, all within the 256 original positions (the head's and the norms' biases, the
    attention biases and the routing all bear on the tokens)."""
    hf_model = make_checkpoint("phimoe_longrope", tmp_path)
    gen = torch.Generator().manual_seed(7)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (30, 101)]
    prompts.append(prompts[1][:90] + torch.randint(0, vocab, (20,), generator=gen).tolist())
    expected = [hf_greedy(hf_model, ids, 24) for ids in prompts]
    engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=4096, chunked_prefill_size=48)
    try:
        params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        first = engine.generate(input_ids=prompts[:2], sampling_params=params)
        last = engine.generate(input_ids=prompts[2], sampling_params=params)
        assert [r["output_ids"] for r in first] + [last["output_ids"]] == expected
        assert last["meta_info"]["cached_tokens"] >= 64
        state = engine.get_internal_state()
        assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    finally:
        engine.shutdown()
