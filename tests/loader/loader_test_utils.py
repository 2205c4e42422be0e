"""Helpers for loader tests: tiny HF Llama models, and GGUF files written the way llama.cpp's
converter writes them (tensor names, q/k row permutation, `llama.*` hyperparameter keys)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

TINY_LLAMA = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
)

# HF suffix -> llama.cpp name of the per-layer tensors
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def make_tiny_llama(tie_word_embeddings: bool = False, seed: int = 0) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, tie_word_embeddings=tie_word_embeddings))
    with torch.no_grad():  # norms away from 1 so a swapped norm would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows (GPT-J rope layout)."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama_cpp_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def write_llama_gguf(state_dict: dict[str, torch.Tensor], config: dict[str, Any], path: Path,
                     quant: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """Write an HF Llama state dict as llama.cpp would: renamed, q/k permuted, 2-D weights in
    `quant` (norms stay F32), hyperparameters under the `llama.` keys."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    for hf_name, tensor in state_dict.items():
        array = tensor.detach().float().numpy()
        if hf_name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config["num_key_value_heads"])
        if array.ndim == 2 and quant != GGMLQuantizationType.F32:
            writer.add_tensor(llama_cpp_name(hf_name), quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(llama_cpp_name(hf_name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
