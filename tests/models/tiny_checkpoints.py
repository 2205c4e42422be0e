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
    # biases on every linear, and sizes the one-row GEMV takes (K a multiple of 64 everywhere)
    "llama_biases_i128": (transformers.LlamaConfig, dict(
        BASE, intermediate_size=128, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False)),
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
    # Gemma (1) / CodeGemma: GeGLU, scaled embeddings, (1 + w) norms, one KV head (2b), tied
    "gemma_mqa": (transformers.GemmaConfig, dict(
        BASE, num_key_value_heads=1, head_dim=16, hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True)),
    # Gemma-2: GeGLU, scaled embeddings, four norms per layer, soft-capped attention and final
    # logits (caps low enough to bend these logits), a window on every other layer, tied
    "gemma2_softcap_window": (transformers.Gemma2Config, dict(
        BASE, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, sliding_window=24,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    # Mixtral: softmax top-2 of 4 experts, renormalised
    "mixtral_moe": (transformers.MixtralConfig, dict(
        BASE, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False)),
    # Phi-3 / Phi-4: Llama's layer, q|k|v and gate|up each stored as one tensor, a window
    # (as Phi-3-mini's 2047) shorter than the longer prompts
    "phi3_merged_window": (transformers.Phi3Config, dict(
        BASE, num_key_value_heads=2, sliding_window=48, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Phi-3.5-mini / Phi-4-mini (longrope): short factors up to a 64-token original context,
    # long ones past it (far apart, so the table matters), Phi-4-mini's partial rotary (12 of
    # 16 dimensions)
    "phi3_longrope": (transformers.Phi3Config, dict(
        BASE, num_key_value_heads=2, original_max_position_embeddings=64,
        partial_rotary_factor=0.75, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0, 1.02, 1.05, 1.1, 1.3, 1.6],
            "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]})),
    # Phi-3.5-MoE (PhimoeForCausalLM): sparsemixer top-2 of 4 (a jitter wide enough that the
    # masks keep some experts and drop others), LayerNorms with biases, biases on q/k/v/o
    # and the head, LongRoPE with its own scale per table (transformers' PhiMoE keeps the
    # short factors past the original context: the tests stay within its 256 positions)
    "phimoe_longrope": (transformers.PhimoeConfig, dict(
        BASE, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.3, attention_bias=True, lm_head_bias=True,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_scaling={
            "rope_type": "longrope", "original_max_position_embeddings": 256,
            "short_factor": [1.0, 1.02, 1.05, 1.1, 1.3, 1.6, 1.8, 2.0],
            "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0, 30.0, 40.0],
            "short_mscale": 1.1, "long_mscale": 1.3})),
    # Command-R+ (CohereForCausalLM): parallel attention and MLP behind one LayerNorm, rope
    # over adjacent pairs after per-head q / k LayerNorms, scaled logits, a tied head
    "cohere_qk_norm": (transformers.CohereConfig, dict(
        BASE, num_key_value_heads=2, use_qk_norm=True, logit_scale=0.5, layer_norm_eps=1e-5,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Command-R7B / Command-A (Cohere2ForCausalLM): windows of 24 with rope on three layers
    # of four, the fourth over the whole context without rope
    "cohere2_window": (transformers.Cohere2Config, dict(
        BASE, num_hidden_layers=4, num_key_value_heads=2, sliding_window=24,
        logit_scale=0.25, layer_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)),
    # SmolLM3: Llama's layer, no rope on every fourth layer, tied
    "smollm3_nope": (transformers.SmolLM3Config, dict(
        BASE, num_hidden_layers=4, num_key_value_heads=2, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Granite 3.x dense: Llama's layer with the embedding, attention, residual and logit
    # multipliers (values far from 1, so each one matters)
    "granite_multipliers": (transformers.GraniteConfig, dict(
        BASE, num_key_value_heads=2, embedding_multiplier=6.0, attention_multiplier=0.05,
        residual_multiplier=0.4, logits_scaling=4.0, tie_word_embeddings=True)),
    # Granite 3.x MoE with a shared MLP (GraniteMoeSharedForCausalLM): top-2 of 4 experts
    # stacked as input_linear / output_linear, the shared gate|up merged, the multipliers
    "granitemoe_shared": (transformers.GraniteMoeSharedConfig, dict(
        BASE, num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=48, embedding_multiplier=6.0,
        attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=4.0,
        tie_word_embeddings=False)),
    # Llama-4 Scout's layout: every layer MoE (top-1 of 4 by a sigmoid router whose weight
    # scales the expert's input, plus a shared expert), rope over adjacent pairs with llama3
    # scaling, q/k L2 norms and chunks of 8 positions on rope layers; the fourth layer NoPE
    # over the whole context with the query temperature from position 3 on (floor_scale 4)
    "llama4_scout": (transformers.Llama4TextConfig, dict(
        BASE, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=1, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
        use_qk_norm=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    # Llama-4 Maverick's layout: MoE on every other layer (dense SwiGLU of
    # intermediate_size_mlp between), no q/k norms, plain rope, chunks of 16
    "llama4_maverick": (transformers.Llama4TextConfig, dict(
        BASE, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=8, attn_scale=0.5,
        use_qk_norm=False, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Qwen2-MoE: q/k/v bias, top-2 of 6 not renormalised, a gated shared expert, layer 0 dense
    "qwen2_moe_shared": (transformers.Qwen2MoeConfig, dict(
        BASE, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
        mlp_only_layers=[0], tie_word_embeddings=False)),
    # Qwen3-MoE: per-head q/k norms, top-3 of 8 renormalised
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        BASE, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)),
    # DeepSeek-V2-Lite layout: MLA without q compression, layer 0 dense, top-2 of 8 experts in
    # 4 groups (2 groups kept), scaled weights, two shared experts, yarn rope with mscale
    "deepseek_v2_lite_mla": (transformers.DeepseekV2Config, dict(
        BASE, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=2.5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                      "rope_theta": 10000.0})),
    # DeepSeek-V2 layout: q compressed through q_lora_rank, greedy top-2
    "deepseek_v2_q_lora": (transformers.DeepseekV2Config, dict(
        BASE, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=0,
        topk_method="greedy", tie_word_embeddings=False)),
    # DeepSeek-V3 (and R1, Kimi-K2) layout: MLA with q compression, layers 0-1 dense, sigmoid
    # scores with a correction bias (randomised below) choosing top-3 of 16 experts in the 2 of
    # 4 groups whose two best biased scores sum highest, weights renormalised and scaled, yarn
    "deepseek_v3_noaux": (transformers.DeepseekV3Config, dict(
        BASE, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=16,
        num_experts_per_tok=3, moe_intermediate_size=24, n_shared_experts=1,
        first_k_dense_replace=2, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "rope_theta": 10000.0})),
    # GLM-4.5 / 4.6 / 4.7: q/k/v bias (none on o_proj), per-head q/k norms, rope over half of
    # each head, layer 0 dense, then V3's routing (sigmoid + correction bias, top-2 of 8 in the
    # best 1 of 2 groups, renormalised, scaled) with a shared expert
    "glm4_moe_partial_rope": (transformers.Glm4MoeConfig, dict(
        BASE, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, moe_intermediate_size=24,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=2, topk_group=1, use_qk_norm=True, attention_bias=True,
        routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False)),
    # GLM-4.7-Flash: DeepSeek-V3's MLA with GLM's MoE, sparse where mlp_layer_types says
    "glm4_moe_lite_mla": (transformers.Glm4MoeLiteConfig, dict(
        BASE, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
        mlp_layer_types=["sparse", "dense", "sparse"], routed_scaling_factor=1.8,
        tie_word_embeddings=False)),
    # gpt-oss: biases on q/k/v/o, a sink logit per head, a window of 24 on every other layer,
    # yarn rope bending these positions; top-2 of 4 experts (router bias, softmax over the two
    # logits), experts with biases and the clamped SwiGLU (limit low enough to clamp here)
    "gpt_oss_sinks_window": (transformers.GptOssConfig, dict(
        BASE, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=24, swiglu_limit=1.5,
        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 64,
                      "rope_theta": 150000.0})),
    # Mistral-4: DeepSeek-V3's MLA with rope over the halves (rope_interleave false), Llama-4's
    # query scaling past an original context of 32 (prompts here run past it), softmax
    # routing with groups ranked by their two best scores (top-2 of 8 in the best 2 of 4),
    # renormalised and scaled, one shared expert, layer 0 dense; all experts of a layer in
    # one tensor (transformers saves Mistral-4 so)
    "mistral4_mla_halves": (transformers.Mistral4Config, dict(
        BASE, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=1.5, rope_interleave=False, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "llama_4_scaling_beta": 0.5})),
    # Gemma-3: Gemma-2's layer plus (1 + w) q/k norms per head; the default layer_types (five
    # sliding layers, window 24, then a full one) with a rope each (local 10k, global 1M), tied
    "gemma3_text": (transformers.Gemma3TextConfig, dict(
        BASE, num_hidden_layers=6, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=24, tie_word_embeddings=True)),
    # Gemma-3 4b-27b style: linear rope scaling on the full layers only, a local base of its
    # own (config.json's rope_scaling / rope_theta / rope_local_base_freq), one KV head (1b)
    "gemma3_linear_rope": (transformers.Gemma3TextConfig, dict(
        BASE, num_hidden_layers=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=28, layer_types=["sliding_attention", "full_attention"] * 2,
        rope_theta=100000.0, rope_local_base_freq=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0}, tie_word_embeddings=True)),
    # Qwen3-Next: Gated DeltaNet layers (2 key heads of 16 serving 4 value heads of 8, conv
    # kernel 4) between gated-attention layers (rope over a quarter of each head); experts
    # top-2 of 4 renormalised with a sigmoid-gated shared expert, layer 2 dense
    "qwen3_next_hybrid": (transformers.Qwen3NextConfig, dict(
        BASE, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32,
        mlp_only_layers=[2], norm_topk_prob=True, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention"] * 2)),
    # OLMo-2: post-norm layers, q/k RMS-normed over the whole projection, the weight
    # multiplied in float32; one KV head (replicated at tp 2: its norm counted once)
    "olmo2_post_norm": (transformers.Olmo2Config, dict(
        BASE, num_key_value_heads=1, tie_word_embeddings=False)),
    # MiniMax-M2: q/k normed over the whole projection (Llama's rounding), rope over the first
    # 8 of 16 per head (the release's legacy `rotary_dim`), sigmoid routing with a correction
    # bias in every layer
    "minimax_m2_qk_norm": (transformers.MiniMaxM2Config, dict(
        BASE, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, rotary_dim=8,
        intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False)),
    # OLMo-3: OLMo-2's layer, a window of 24 on three layers of four, a rope per layer type
    "olmo3_window": (transformers.Olmo3Config, dict(
        BASE, num_hidden_layers=4, num_key_value_heads=2, sliding_window=24,
        tie_word_embeddings=False)),
    # OLMo-Hybrid: pre-norm Gated DeltaNet layers with separate q/k/v/g/a/b projections and
    # beta doubled (negative eigenvalues), between OLMo-3's post-norm attention layers
    "olmo_hybrid": (transformers.OlmoHybridConfig, dict(
        BASE, num_hidden_layers=4, num_key_value_heads=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention"] * 2, pad_token_id=0,
        bos_token_id=None, eos_token_id=2)),
    # Qwen3.5 (dense): the same mixers, its projections stored apart (in_proj_qkv / z / b /
    # a), key heads as many as value heads, tied embeddings
    "qwen3_5_dense": (transformers.Qwen3_5TextConfig, dict(
        BASE, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=True,
        layer_types=["linear_attention", "linear_attention", "full_attention",
                     "linear_attention"])),
    # Nemotron-H: Mamba-2 mixers (8 heads of 8 in 2 groups of B/C, state 16, conv 4 with a
    # bias), attention without rope, ReLU-squared MLPs, each its own pre-norm layer
    "nemotron_h": (transformers.NemotronHConfig, dict(
        {k: v for k, v in BASE.items() if k not in ("num_hidden_layers", "rms_norm_eps")},
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp",
                           "linear_attention", "mlp"],
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=8,
        ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # the same with one group of B/C (Granite-4.0-H's and Bamba's count): at tp 2 each rank
    # holds it whole and the gated norm's one group spans both ranks
    "nemotron_h_one_group": (transformers.NemotronHConfig, dict(
        {k: v for k, v in BASE.items() if k not in ("num_hidden_layers", "rms_norm_eps")},
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=1, conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Nemotron-3-Nano: MoE layers of ungated ReLU-squared experts (top 2 of 8, sigmoid scores
    # with a correction bias, 4 groups of which 2 are kept) beside a shared expert
    "nemotron_h_moe": (transformers.NemotronHConfig, dict(
        {k: v for k, v in BASE.items() if k not in ("num_hidden_layers", "rms_norm_eps")},
        layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=8,
        ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=32, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    # Nemotron-3-Super's kind: the routed experts in a 32-wide latent space between two
    # projections, the router and shared expert on the full width
    "nemotron_h_latent_moe": (transformers.NemotronHConfig, dict(
        {k: v for k, v in BASE.items() if k not in ("num_hidden_layers", "rms_norm_eps")},
        layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
        num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=1, conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=32, moe_latent_size=32, n_group=1, topk_group=1,
        norm_topk_prob=True, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    # Granite-4.0-H (MoE, as H-Tiny / H-Small): Mamba-2 layers (one group of B/C) and
    # rope-less attention scaled by attention_multiplier, each with top-2-of-4 experts beside
    # a shared MLP; Granite's embedding, residual and logit multipliers
    "granite_hybrid_moe": (transformers.GraniteMoeHybridConfig, dict(
        BASE, num_hidden_layers=4, num_key_value_heads=2, intermediate_size=32,
        shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "attention", "linear_attention", "linear_attention"],
        mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4,
        mamba_chunk_size=16, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=2.5, position_embedding_type="nope",
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Granite-4.0-H-Micro's kind: no experts (the shared MLP alone), rope in attention
    "granite_hybrid_dense": (transformers.GraniteMoeHybridConfig, dict(
        BASE, num_hidden_layers=3, num_key_value_heads=2, shared_intermediate_size=48,
        num_local_experts=0, layer_types=["linear_attention", "attention", "linear_attention"],
        mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_head=32, mamba_d_conv=4,
        mamba_chunk_size=16, embedding_multiplier=3.0, residual_multiplier=0.7,
        attention_multiplier=0.25, logits_scaling=1.5, position_embedding_type="rope",
        rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    # Bamba: Granite-4.0-H-Micro's layers under other names, rope over half of each head
    "bamba": (transformers.BambaConfig, dict(
        BASE, num_hidden_layers=3, num_key_value_heads=2, attn_layer_indices=[1],
        mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4,
        mamba_chunk_size=16, rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)),
    # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer (the mixer's
    # width mamba_d_ssm, its norm before the gate), every µP multiplier away from 1
    "falcon_h1": (transformers.FalconH1Config, dict(
        BASE, num_hidden_layers=3, num_key_value_heads=2, mamba_d_ssm=96, mamba_n_heads=6,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
        mamba_rms_norm=True, mamba_norm_before_gate=True, rope_theta=10000.0,
        embedding_multiplier=1.5, lm_head_multiplier=0.7, key_multiplier=0.8,
        attention_in_multiplier=1.2, attention_out_multiplier=0.9, ssm_in_multiplier=1.1,
        ssm_out_multiplier=0.6, ssm_multipliers=[0.9, 1.2, 0.8, 1.3, 0.7],
        mlp_multipliers=[1.4, 0.6], tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)),
    # the same with the mixer's width from mamba_expand (no mamba_d_ssm), the gate before the
    # norm: at tp 2 the multipliers fold over the checkpoint's whole width
    "falcon_h1_expand": (transformers.FalconH1Config, dict(
        BASE, num_hidden_layers=2, num_key_value_heads=2, mamba_d_ssm=None, mamba_n_heads=8,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
        mamba_rms_norm=True, mamba_norm_before_gate=False, rope_theta=10000.0,
        ssm_in_multiplier=1.1, ssm_multipliers=[0.9, 1.2, 0.8, 1.3, 0.7],
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}

# multimodal checkpoints, served text-only (LLaVA's, Gemma-3's, Mistral Small 3.1's: with their
# images); kept out of CONFIGS, every entry of which test_llama_vs_hf.py runs reading vocab_size
# from the config's top level (here text_config's)
# the Qwen VL checkpoints' vision token ids (tests/models/qwen_vl_folder.py's tokenizer's),
# untied
QWEN_VL_IDS = dict(image_token_id=159, video_token_id=156, vision_start_token_id=157,
                   vision_end_token_id=158, tie_word_embeddings=False)


def qwen3_vl(**text_extra: object) -> dict[str, object]:
    """Qwen3-VL's tiny checkpoint (Qwen3-VL-MoE's with its experts in `text_extra`): a Qwen3
    decoder with interleaved multimodal rope (sections 2 / 3 / 3 of 8 pairs), Qwen3.5's tiny
    tower with DeepStack mergers after its first two blocks, added after the first two decoder
    layers."""
    return dict(
        text_config=dict(BASE, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}, **text_extra),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                           out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
        **QWEN_VL_IDS)


MULTIMODAL_CONFIGS = {
    # Llama-4's released layout (Llama4ForConditionalGeneration): "llama4_scout"'s decoder
    # under language_model.*, a one-layer vision tower and projector beside it (served
    # text-only: their tensors are skipped)
    "llama4_multimodal": (transformers.Llama4Config, dict(
        text_config=CONFIGS["llama4_scout"][1],
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=48, image_size=28, patch_size=14,
                           vision_output_dim=32, projector_input_dim=32,
                           projector_output_dim=64, pixel_shuffle_ratio=0.5),
        image_token_index=159, tie_word_embeddings=False)),
    # LLaVA-1.5 (LlavaForConditionalGeneration): a CLIP tower (class token, pre_layrnorm,
    # quick_gelu) of 3 layers read after its second (vision_feature_layer -2, the third never
    # runs), 16 patches of 7x7 ("default": the class token dropped), a Llama decoder with a
    # vocabulary holding the image token, the projector with biases
    "llava": (transformers.LlavaConfig, dict(
        text_config=dict(BASE, model_type="llama", vocab_size=300, num_key_value_heads=2,
                         tie_word_embeddings=False),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                           intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                           image_size=28, patch_size=7, projection_dim=16),
        image_token_id=299, vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", tie_word_embeddings=False)),
    # the same with a SigLIP tower (conv bias, no class token, gelu_pytorch_tanh, a pooling
    # head the features never use) read after its last layer, 36 patches of 4x4 all kept
    # ("full"), a Qwen2 decoder (q/k/v bias), a projector without biases
    "llava_siglip": (transformers.LlavaConfig, dict(
        text_config=dict(BASE, model_type="qwen2", vocab_size=300, num_key_value_heads=2,
                         tie_word_embeddings=False),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                           intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=24, patch_size=4),
        image_token_id=299, vision_feature_layer=-1, vision_feature_select_strategy="full",
        projector_hidden_act="gelu_pytorch_tanh", multimodal_projector_bias=False,
        tie_word_embeddings=False)),
    # pixtral-12b (LlavaForConditionalGeneration around a Pixtral tower): "mistral3_multimodal"'s
    # Mistral decoder and tiny tower (8x8 patches, no merge: one image token per patch, images
    # up to 64 pixels a side) read after its last layer, every patch kept ("full"), LLaVA's
    # projector with biases
    "llava_pixtral": (transformers.LlavaConfig, dict(
        text_config=dict(BASE, model_type="mistral", num_key_value_heads=2, head_dim=24,
                         sliding_window=None, rope_theta=1000000000.0,
                         tie_word_embeddings=False),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=64,
                           patch_size=8, head_dim=16, hidden_act="silu"),
        image_token_index=159, vision_feature_layer=-1, vision_feature_select_strategy="full",
        projector_hidden_act="gelu", tie_word_embeddings=False)),
    # Gemma-3 4b-27b (Gemma3ForConditionalGeneration, what AutoModelForCausalLM makes of a
    # Gemma3Config): the language model in text_config (five sliding layers, window 24, then a
    # full one whose rope is linearly scaled, as the 4b-27b configs' rope_scaling), a tiny
    # SigLIP vision tower (8x8 patches of 4x4 pixels, a pooling head the features never use)
    # and the projector beside it (the grid pooled 2x2: 16 tokens an image, which fit in the
    # window), the EOS ids [1, 106] at the top level only (text_config's default is 1), tied
    # as the whole model says; the image ids are test_gemma3_multimodal.py's tokenizer's
    "gemma3_multimodal": (transformers.Gemma3Config, dict(
        text_config=dict(BASE, num_hidden_layers=6, num_key_value_heads=2, head_dim=16,
                         query_pre_attn_scalar=16, sliding_window=24,
                         rope_scaling={"rope_type": "linear", "factor": 8.0}),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=2, image_size=32, patch_size=4),
        mm_tokens_per_image=16, boi_token_index=157, eoi_token_index=158, image_token_index=159,
        eos_token_id=[1, 106], tie_word_embeddings=True)),
    # Mistral Small 3.1 / 3.2 (Mistral3ForConditionalGeneration): a Mistral decoder in
    # text_config (GQA, head_dim not hidden / heads, untied), a tiny Pixtral vision tower (2
    # layers, silu as the hub's, 8x8 patches, images up to 64 pixels a side) and the projector
    # beside it (patches merged 2x2: one image token per 16x16 pixels)
    "mistral3_multimodal": (transformers.Mistral3Config, dict(
        text_config=dict(BASE, model_type="mistral", num_key_value_heads=2, head_dim=24,
                         sliding_window=None, rope_theta=1000000000.0,
                         tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=64, patch_size=8, head_dim=16,
                           hidden_act="silu"),
        spatial_merge_size=2, image_token_index=159, tie_word_embeddings=False)),
    # Mistral Small 4 (Mistral3ForConditionalGeneration around a Mistral-4 decoder: MLA, MoE
    # with stacked experts, rope over adjacent pairs), the tiny Pixtral tower beside it
    "mistral4_multimodal": (transformers.Mistral3Config, dict(
        text_config=dict(BASE, model_type="mistral4", num_hidden_layers=3, num_key_value_heads=4,
                         kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
                         first_k_dense_replace=1, tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8, head_dim=16),
        image_token_index=159, tie_word_embeddings=False)),
    # Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): a Qwen2 decoder (q/k/v bias, untied)
    # whose rope is multimodal (sections 2 / 3 / 3 of its 8 rotary pairs), a tiny tower of
    # 4x4 patches merged 2x2, windows of 16 pixels (2x2 image tokens) in every block but the
    # second; the image ids are test_qwen2_vl_images.py's tokenizer's
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, dict(
        text_config=dict(BASE, num_key_value_heads=2, tie_word_embeddings=False,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         rope_theta=10000.0),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, patch_size=4, temporal_patch_size=2,
                           spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1]),
        **QWEN_VL_IDS)),
    # Qwen2-VL (Qwen2VLForConditionalGeneration): the same decoder, the older tower (LayerNorms,
    # an fc1 / fc2 quick_gelu MLP, every block over the whole image)
    "qwen2_vl": (transformers.Qwen2VLConfig, dict(
        text_config=dict(BASE, num_key_value_heads=2, tie_word_embeddings=False,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         rope_theta=10000.0),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2),
        **QWEN_VL_IDS)),
    # Qwen3-VL (Qwen3VLForConditionalGeneration; `qwen3_vl` says what it holds)
    "qwen3_vl": (transformers.Qwen3VLConfig, qwen3_vl()),
    # Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration): the same with a Qwen3-MoE decoder,
    # experts top-2 of 4, stored stacked (experts.gate_up_proj / experts.down_proj)
    "qwen3_vl_moe": (transformers.Qwen3VLMoeConfig, qwen3_vl(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        decoder_sparse_step=1)),
    # Qwen3.5 with its images (Qwen3_5ForConditionalGeneration): the hybrid decoder (two full
    # attention layers of four) whose rope covers half of each 32-wide head, interleaved over
    # sections 2 / 3 / 3 of its 8 pairs; a tiny tower of 4x4 patches merged 2x2 with a 4x4
    # table of position embeddings (resampled to each image's grid), untied
    "qwen3_5_vl": (transformers.Qwen3_5Config, dict(
        text_config=dict(BASE, num_hidden_layers=4, num_key_value_heads=2, head_dim=32,
                         linear_num_key_heads=2, linear_num_value_heads=2,
                         linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_conv_kernel_dim=4,
                         layer_types=["linear_attention", "full_attention"] * 2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5,
                                          "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                           out_hidden_size=64, num_position_embeddings=16),
        **QWEN_VL_IDS)),
    # Qwen3.5-MoE (Qwen3_5MoeForConditionalGeneration): the hybrid decoder with experts top-2
    # of 4 (always renormalised) and a gated shared expert, a tiny vision tower beside it;
    # tied by the top-level flag (transformers saves text_config's as false)
    "qwen3_5_moe_multimodal": (transformers.Qwen3_5MoeConfig, dict(
        text_config=dict(BASE, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=8,
                         linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=24, shared_expert_intermediate_size=32,
                         layer_types=["linear_attention", "full_attention"] * 2),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                           patch_size=4, out_hidden_size=64, num_position_embeddings=16),
        image_token_id=159, video_token_id=158, vision_start_token_id=157,
        tie_word_embeddings=True)),
}


# checkpoints whose model class transformers' AutoModelForCausalLM does not map (Mistral-4 is
# mapped for pretraining and image-text-to-text only)
DIRECT_CLASSES = {"mistral4_mla_halves": "Mistral4ForCausalLM"}


def make_checkpoint(name: str, folder: Path, seed: int = 0) -> transformers.PreTrainedModel:
    config_cls, kwargs = CONFIGS[name] if name in CONFIGS else MULTIMODAL_CONFIGS[name]
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    auto = transformers.AutoModelForImageTextToText if name in MULTIMODAL_CONFIGS else \
        transformers.AutoModelForCausalLM
    if name in DIRECT_CLASSES:  # not in transformers' causal-LM auto mapping
        model = getattr(transformers, DIRECT_CLASSES[name])._from_config(config,
                                                                         dtype=torch.float32)
    else:
        model = auto.from_config(config, dtype=torch.float32)
    # random init of transformers is small; make attention matter with larger weights
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("A_log"):  # linear attention: a decay that keeps ~50 tokens
                param.uniform_(-5.0, -3.0)
            elif param.dim() >= 2:  # matrices, and stacked experts
                param.normal_(0, 0.08)
            elif "bias" in param_name:
                param.normal_(0, 0.1)
            else:
                param.uniform_(0.8, 1.2)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # DeepSeek-V3: zeros at init
                buffer.normal_(0, 0.3)
    model.save_pretrained(folder)
    return model.eval()
