"""Tiny random Hugging Face checkpoints, written with transformers' own save_pretrained."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5)

CONFIGS = {
    # GQA (4 q heads, 2 kv heads) and llama3 rope scaling that actually bends the frequencies
    "llama_gqa_llama3_rope": (transformers.LlamaConfig, dict(
        BASE, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Qwen2: bias on q/k/v
    "qwen2_bias": (transformers.Qwen2Config, dict(
        BASE, num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=False)),
    # tied embeddings, MHA
    "llama_tied_mha": (transformers.LlamaConfig, dict(
        BASE, num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral_gqa": (transformers.MistralConfig, dict(
        BASE, num_key_value_heads=1, sliding_window=None, tie_word_embeddings=False)),
    # Mistral v0.1: every layer attends over a window (prompts here run past it)
    "mistral_window32": (transformers.MistralConfig, dict(
        BASE, num_key_value_heads=2, sliding_window=32, tie_word_embeddings=False)),
    # Qwen3: per-head q/k RMSNorm, no bias, head_dim not hidden / heads
    "qwen3_qk_norm": (transformers.Qwen3Config, dict(
        BASE, num_key_value_heads=2, head_dim=24, rope_theta=1000000.0,
        tie_word_embeddings=False)),
    # Gemma-2: GeGLU, scaled embeddings, four norms per layer, soft-capped attention and final
    # logits (caps low enough to bend these logits), a window on every other layer, tied
    "gemma2_softcap_window": (transformers.Gemma2Config, dict(
        BASE, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, sliding_window=24,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
}


def make_checkpoint(name: str, folder: Path, seed: int = 0) -> transformers.PreTrainedModel:
    config_cls, kwargs = CONFIGS[name]
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # random init of transformers is small; make attention matter with larger weights
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0, 0.08)
            elif "bias" in param_name:
                param.normal_(0, 0.1)
            else:
                param.uniform_(0.8, 1.2)
    model.save_pretrained(folder)
    return model.eval()
