"""Parameter counts of a model config, for the roofline: dense (Llama-like), MoE (routed and
shared experts, dense first layers) and MLA (DeepSeek-V2's latent attention) layers.

`linear` counts every weight that takes part in a matmul (LM head excluded); `active_linear`
only those one token multiplies (an MoE token uses its top-k routed experts, not all of them).
`routed_expert` is one routed expert of one layer (gate, up, down), `moe_layers` how many layers
route, so a decode step of b tokens reads about distinct_experts(b) of each MoE layer's experts.
"""
from __future__ import annotations

from typing import NamedTuple

from radixserve.core.model_config import ModelConfig


class ParamCounts(NamedTuple):
    embedding: int  # the input embedding table (gathered, not multiplied)
    layers: int  # all decoder layers: linear weights, biases, norms
    final_norm: int
    lm_head: int  # vocab x hidden; the same matrix as `embedding` when tied
    linear: int  # weights that take part in matmuls, LM head excluded
    total: int  # distinct parameters (a tied LM head counted once)
    active_linear: int = 0  # linear weights one token multiplies (MoE: top-k experts only)
    routed_expert: int = 0  # one routed expert of one layer
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0

    def distinct_experts(self, num_tokens: int) -> float:
        """Routed experts of one layer that num_tokens tokens use, if routing were uniform."""
        if not self.num_experts:
            return 0.0
        unused = (1.0 - self.top_k / self.num_experts) ** num_tokens
        return self.num_experts * (1.0 - unused)


def attention_params(cfg: ModelConfig) -> tuple[int, int]:
    """(linear weights, biases and norms) of one attention block."""
    hf, h = cfg.hf, cfg.hidden_size
    if getattr(hf, "kv_lora_rank", None):  # MLA
        heads = cfg.num_attention_heads
        qk = hf.qk_nope_head_dim + hf.qk_rope_head_dim
        q_rank = getattr(hf, "q_lora_rank", None)
        q = h * q_rank + q_rank * heads * qk if q_rank else h * heads * qk
        linear = q + h * (hf.kv_lora_rank + hf.qk_rope_head_dim) + \
            hf.kv_lora_rank * heads * (hf.qk_nope_head_dim + hf.v_head_dim) + \
            heads * hf.v_head_dim * h
        return linear, hf.kv_lora_rank + (q_rank or 0)
    kv_dim, q_dim = cfg.num_key_value_heads * cfg.head_dim, cfg.num_attention_heads * cfg.head_dim
    bias = 0
    if cfg.attention_bias:  # Qwen2 and GLM bias q/k/v only; Llama's flag also biases o_proj
        bias = q_dim + 2 * kv_dim + (h if cfg.o_proj_bias else 0)
    model_type = getattr(hf, "model_type", "")
    norms = 2 * cfg.head_dim if model_type.startswith("qwen3") else 0
    if model_type.startswith(("olmo", "minimax_m2")):  # q/k norms over whole projections
        norms = q_dim + kv_dim
    return h * q_dim + 2 * h * kv_dim + q_dim * h, bias + norms


class _Moe(NamedTuple):
    num_experts: int
    top_k: int
    expert_size: int
    shared_size: int
    shared_gate: bool


def _moe_shape(cfg: ModelConfig) -> _Moe | None:
    hf = cfg.hf
    arch = cfg.architecture
    if arch in ("MixtralForCausalLM", "MiniMaxM2ForCausalLM", "PhimoeForCausalLM"):  # no shared
        return _Moe(hf.num_local_experts, hf.num_experts_per_tok, cfg.intermediate_size, 0,
                    False)
    if arch.startswith("Llama4"):  # moe_layers; a shared expert of the routed ones' size
        return _Moe(hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size,
                    hf.intermediate_size, False)
    if arch == "GptOssForCausalLM":  # every layer; the experts' biases are not counted
        return _Moe(hf.num_local_experts, hf.num_experts_per_tok, cfg.intermediate_size, 0,
                    False)
    mla_moe = arch.startswith(("DeepseekV2", "DeepseekV3", "Glm4Moe", "Mistral4")) or \
        getattr(hf, "model_type", None) == "mistral4"  # Mistral Small 4 too
    if mla_moe and hf.n_routed_experts:
        return _Moe(hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
                    hf.moe_intermediate_size * (hf.n_shared_experts or 0), False)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM") or \
            (arch.startswith("Qwen3_5") and getattr(hf, "num_experts", 0)):
        shared = getattr(hf, "shared_expert_intermediate_size", 0) or 0
        return _Moe(hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, shared,
                    bool(shared))
    return None


def _is_moe_layer(cfg: ModelConfig, layer_id: int) -> bool:
    hf = cfg.hf
    if cfg.architecture.startswith("Llama4"):
        return layer_id in hf.moe_layers
    if cfg.architecture.startswith(("DeepseekV2", "DeepseekV3", "Glm4Moe", "Mistral4")) or \
            getattr(hf, "model_type", None) == "mistral4":
        layer_types = getattr(hf, "mlp_layer_types", None)  # GLM-4.7-Flash lists them
        if layer_types:
            return layer_types[layer_id] == "sparse"
        return layer_id >= hf.first_k_dense_replace
    if cfg.architecture.startswith("Qwen"):
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        return layer_id not in (getattr(hf, "mlp_only_layers", None) or []) and \
            (layer_id + 1) % step == 0
    return True


def _layer_kinds(cfg: ModelConfig) -> list[str]:
    """Each layer's kind: "linear_attention" for the recurrent mixers of hybrid models (Gated
    DeltaNet, Mamba-2), "mlp" / "moe" for Nemotron-H's layers of an MLP alone, else
    "attention"."""
    types = cfg.layer_types or ()
    if "linear_attention" not in types:
        return ["attention"] * cfg.num_hidden_layers
    return [t if t in ("linear_attention", "mlp", "moe") else "attention" for t in types]


def _linear_attention_params(cfg: ModelConfig) -> tuple[int, int]:
    """(linear weights, the rest) of one Gated DeltaNet: q|k|v|z and b|a in, out; the
    depthwise conv, A_log, dt_bias and the gated norm."""
    hf, h = cfg.hf, cfg.hidden_size
    keys = hf.linear_num_key_heads * hf.linear_key_head_dim
    values = hf.linear_num_value_heads * hf.linear_value_head_dim
    linear = h * (2 * keys + 2 * values + 2 * hf.linear_num_value_heads) + values * h
    other = (2 * keys + values) * hf.linear_conv_kernel_dim + 2 * hf.linear_num_value_heads + \
        hf.linear_value_head_dim
    return linear, other


def recurrent_state_bytes(cfg: ModelConfig, conv_itemsize: int = 2) -> int:
    """One request's states in all linear-attention layers (float32 recurrent state, the conv's
    last inputs in the model dtype): what a decode step reads and writes per request."""
    from radixserve.bench.mamba_counts import MAMBA_HYBRIDS, mamba_state_bytes
    if cfg.architecture in MAMBA_HYBRIDS:
        return mamba_state_bytes(cfg, conv_itemsize)
    kinds = _layer_kinds(cfg)
    if "linear_attention" not in kinds:
        return 0
    hf = cfg.hf
    ssm = hf.linear_num_value_heads * hf.linear_key_head_dim * hf.linear_value_head_dim * 4
    channels = 2 * hf.linear_num_key_heads * hf.linear_key_head_dim + \
        hf.linear_num_value_heads * hf.linear_value_head_dim
    conv = (hf.linear_conv_kernel_dim - 1) * channels * conv_itemsize
    return kinds.count("linear_attention") * (ssm + conv)


def param_counts(cfg: ModelConfig) -> ParamCounts:
    h = cfg.hidden_size
    from radixserve.bench.mamba_counts import MAMBA_HYBRIDS, mamba_hybrid_counts
    if cfg.architecture in MAMBA_HYBRIDS:
        return mamba_hybrid_counts(cfg)
    attn_linear, attn_other = attention_params(cfg)
    kinds = _layer_kinds(cfg)
    if "linear_attention" in kinds and getattr(cfg.hf, "model_type", "").startswith("qwen3"):
        # Qwen3-Next / Qwen3.5's gated attention: each q head also projects its gate
        attn_linear += h * cfg.num_attention_heads * cfg.head_dim
    mixers = {"attention": (attn_linear, attn_other)}
    if "linear_attention" in kinds:
        mixers["linear_attention"] = _linear_attention_params(cfg)
    # Llama-4's dense layers are wider than its experts
    dense_size = getattr(cfg.hf, "intermediate_size_mlp", None) or cfg.intermediate_size
    dense_mlp = 3 * h * dense_size
    dense_bias = 2 * dense_size + h if cfg.mlp_bias else 0
    moe = _moe_shape(cfg)
    layers = linear = active = moe_layers = 0
    for layer_id in range(cfg.num_hidden_layers):
        attn_linear, attn_other = mixers[kinds[layer_id]]
        if moe is not None and _is_moe_layer(cfg, layer_id):
            routed = 3 * h * moe.expert_size
            router = h * moe.num_experts + (h if moe.shared_gate else 0)
            shared = 3 * h * moe.shared_size
            layer_linear = attn_linear + router + moe.num_experts * routed + shared
            layer_active = attn_linear + router + moe.top_k * routed + shared
            layer_other = attn_other
            moe_layers += 1
        else:
            layer_linear = layer_active = attn_linear + dense_mlp
            layer_other = attn_other + dense_bias
        layers += layer_linear + layer_other + 2 * h  # two RMSNorms
        linear += layer_linear
        active += layer_active
    embedding = lm_head = cfg.vocab_size * h
    total = embedding + layers + h + (0 if cfg.tie_word_embeddings else lm_head)
    return ParamCounts(embedding, layers, h, lm_head, linear, total, active,
                       3 * h * moe.expert_size if moe else 0, moe_layers,
                       moe.num_experts if moe else 0, moe.top_k if moe else 0)


def attended_keys(cfg: ModelConfig, context: float) -> float:
    """Keys the query at position context - 1 attends to, averaged over the attention layers:
    the whole context in full layers, at most W in a window of W, the positions of its own
    chunk in Llama-4's chunked layers."""
    kinds = _layer_kinds(cfg)
    layers = [i for i, kind in enumerate(kinds) if kind == "attention"]
    chunk = getattr(cfg.hf, "attention_chunk_size", None)
    total = 0.0
    for layer_id in layers:
        keys = context
        window = cfg.layer_sliding_window(layer_id)
        if window:
            keys = min(context, window)
        if chunk and cfg.layer_types and cfg.layer_types[layer_id] == "chunked_attention":
            keys = (context - 1) % chunk + 1
        total += keys
    return total / max(len(layers), 1)


def attention_flops_per_key(cfg: ModelConfig, absorbed: bool = False) -> float:
    """FLOPs of one query token against one key in all layers. MLA: decompressed (prefill)
    multiplies per head [nope + rope] then [v]; absorbed (decode) [latent + rope] then
    [latent]."""
    hf = cfg.hf
    heads, layers = cfg.num_attention_heads, _layer_kinds(cfg).count("attention")
    if getattr(hf, "kv_lora_rank", None):
        if absorbed:
            per_head = (hf.kv_lora_rank + hf.qk_rope_head_dim) + hf.kv_lora_rank
        else:
            per_head = hf.qk_nope_head_dim + hf.qk_rope_head_dim + hf.v_head_dim
        return 2.0 * layers * heads * per_head
    return 4.0 * layers * heads * cfg.head_dim
