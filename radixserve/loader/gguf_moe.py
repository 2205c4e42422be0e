"""Mixture-of-experts GGUF files: Mixtral ("llama" with experts), Qwen2-MoE ("qwen2moe") and
Qwen3-MoE ("qwen3moe"), as llama.cpp's converter writes them.

llama.cpp stacks a layer's experts into one tensor per projection: `blk.N.ffn_gate_exps`,
`ffn_up_exps` ([experts, intermediate, hidden] in torch order) and `ffn_down_exps`
([experts, hidden, intermediate]); slab e is expert e's HF weight as it is. Their layer-name
entries below are HF names with an `{expert}` field: `gguf_loader.iter_gguf_weights` yields one
HF-named tensor per expert (`...experts.3.w1.weight`), dequantised one slab at a time, so the
models' per-expert loaders (`FusedMoE.weight_loader`) take GGUF and safetensors files alike.

The router `ffn_gate_inp` is HF's `gate`; Qwen2-MoE's shared expert is `ffn_*_shexp` and its
sigmoid gate `ffn_gate_inp_shexp`, which llama.cpp declares 1-D ([hidden]) where HF has [1, hidden].

Routing is fixed per architecture in llama.cpp's graphs, not read from the file: Mixtral and
Qwen3-MoE renormalise the top-k softmax weights, Qwen2-MoE does not (norm_topk_prob). Every layer
of a qwen2moe / qwen3moe file is sparse (llama.cpp has no dense layers for them).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

EXPERT = "{expert}"  # where a stacked tensor's HF name takes the expert id
SHARED_EXPERT_GATE = "mlp.shared_expert_gate.weight"  # [1, hidden] in HF, [hidden] in GGUF

# key(name, default): the file's `{arch}.{name}` metadata value
MetaKey = Callable[..., Any]

MIXTRAL_LAYER_NAMES = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": f"block_sparse_moe.experts.{EXPERT}.w1",
    "ffn_up_exps": f"block_sparse_moe.experts.{EXPERT}.w3",
    "ffn_down_exps": f"block_sparse_moe.experts.{EXPERT}.w2",
}
# Mixtral files converted before llama.cpp stacked the experts (December 2023) hold one 2-D
# tensor per expert: blk.N.ffn_gate.E.weight, ffn_up.E, ffn_down.E
LEGACY_MIXTRAL_EXPERT = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")
_LEGACY_PIECES = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}


def legacy_mixtral_expert_name(gguf_name: str) -> str | None:
    """The HF name of an unstacked Mixtral expert tensor, or None for any other tensor."""
    found = LEGACY_MIXTRAL_EXPERT.match(gguf_name)
    if found is None:
        return None
    layer, piece, expert = found.groups()
    return (f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
            f"{_LEGACY_PIECES[piece]}.weight")


QWEN_MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
    "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
    "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
}
QWEN2_MOE_SHARED_NAMES = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


def _expert_counts(key: MetaKey) -> dict[str, int]:
    return {"num_experts": int(key("expert_count")),
            "num_experts_per_tok": int(key("expert_used_count"))}


def llama_moe_config(key: MetaKey, config: dict[str, Any]) -> dict[str, Any]:
    """A "llama" file with experts is Mixtral (the experts' size is feed_forward_length, as
    Mixtral's intermediate_size); without, nothing to add."""
    if not key("expert_count", 0):
        return {}
    counts = _expert_counts(key)
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": counts["num_experts"],
            "num_experts_per_tok": counts["num_experts_per_tok"]}


def _qwen_moe_config(key: MetaKey, config: dict[str, Any], norm_topk_prob: bool
                     ) -> dict[str, Any]:
    """The Qwen MoE fields; a file without expert_feed_forward_length gets llama.cpp's default,
    feed_forward_length / experts used."""
    counts = _expert_counts(key)
    expert_size = key("expert_feed_forward_length",
                      config["intermediate_size"] // counts["num_experts_per_tok"])
    return {**counts, "moe_intermediate_size": int(expert_size),
            "norm_topk_prob": norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": []}


def qwen2moe_config(key: MetaKey, config: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE: top-k weights not renormalised, a shared expert (llama.cpp's default size
    without expert_shared_feed_forward_length: feed_forward_length)."""
    shared = key("expert_shared_feed_forward_length", config["intermediate_size"])
    return {**_qwen_moe_config(key, config, norm_topk_prob=False),
            "shared_expert_intermediate_size": int(shared)}


def qwen3moe_config(key: MetaKey, config: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE: top-k weights renormalised, no shared expert."""
    return _qwen_moe_config(key, config, norm_topk_prob=True)
