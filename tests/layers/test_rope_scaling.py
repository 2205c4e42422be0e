"""Rope tables of every supported scaling kind equal transformers' own (cos and sin, attention
factor folded in), so scaled models see the positions transformers gives them."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from radixserve.core.model_config import ModelConfig
from radixserve.layers.rotary import RotaryEmbedding

BASE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
     "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3},
])
def test_rope_tables_match_transformers(rope: dict | None) -> None:
    hf_config = transformers.LlamaConfig(**BASE, **({"rope_scaling": rope} if rope else {}))
    ours = RotaryEmbedding.from_config(ModelConfig(hf_config))
    positions = torch.tensor([[0, 1, 17, 63, 64, 200, 511]])
    x = torch.zeros(1, 7, 16)
    cos, sin = LlamaRotaryEmbedding(hf_config)(x, positions)
    torch.testing.assert_close(ours.cos_cache[positions[0]], cos[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours.sin_cache[positions[0]], sin[0], atol=1e-6, rtol=1e-6)
    if rope is not None and rope["rope_type"] == "yarn":
        assert not torch.allclose(ours.cos_cache[0], torch.ones(16))  # the factor is applied
