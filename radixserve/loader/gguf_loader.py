"""GGUF (llama.cpp) checkpoints as an HF-style config dict and HF-named fp32 tensors.

llama.cpp names tensors `token_embd`, `blk.N.attn_q`, ...; we rename them to the names a
transformers `LlamaForCausalLM` state dict uses, so models load GGUF and safetensors the same way.

Invariant on q/k: llama.cpp's converter permutes the rows of `attn_q` / `attn_k` of Llama models
so that each head's rotary pairs are interleaved (GPT-J style, pairs (2i, 2i+1)) instead of split
in halves (GPT-NeoX style, pairs (i, i + d/2)) as in HF checkpoints. `unpermute_qk` undoes it; the
weights we yield are in HF layout.

Weights are deliberately not cached: dequantizing all of the bundled 135M model takes 0.7-1.5 s
on a 2-core CPU, and reading an fp32 safetensors copy instead (538 MB on disk, 1.35 s to write
once) takes 0.1-0.45 s: under a second saved per start, for half a gigabyte per model file.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from radixserve.loader import gguf_dequant
from radixserve.loader.cache_dir import file_cache_folder, read_cached_json, write_json_atomically
from radixserve.loader.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf

# general.architecture -> (HF architecture, whether q/k rows were permuted by the converter)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}

_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp writes that have no HF counterpart (rope_freqs: llama3 rope factors, which
# the HF config expresses through rope_scaling instead).
_SKIPPED_TENSORS = {"rope_freqs.weight"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _f32(value: float) -> float:
    """The shortest decimal that round-trips a float32 metadata value (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def gguf_architecture(gguf: GGUFFile) -> str:
    arch = gguf.metadata.get("general.architecture", "")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{gguf.path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {sorted(GGUF_ARCHITECTURES)})")
    return arch


def gguf_to_hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """An HF `config.json`-style dict for the model the GGUF describes (accepted by
    `ModelConfig.from_hf_dict`)."""
    arch = gguf_architecture(gguf)
    meta = gguf.metadata

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden_size = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    n_kv_heads = int(key("attention.head_count_kv", n_heads))
    head_dim = int(key("attention.key_length", hidden_size // n_heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = key("vocab_size") or (len(tokens) if tokens else
                                       gguf.tensors["token_embd.weight"].shape[0])
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch][0]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "torch_dtype": "bfloat16",
    }
    for hf_key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                             ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                             ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if gguf_key in meta:
            config[hf_key] = int(meta[gguf_key])
    rope_scaling = _rope_scaling(meta, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor", 1.0)
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def hf_tensor_name(gguf_name: str) -> str | None:
    """The transformers state-dict name of a llama.cpp tensor; None for tensors HF has not."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    match = _LAYER_NAME.match(gguf_name)
    if match:
        layer, part, suffix = match.groups()
        if part not in _LAYER_TENSOR_NAMES:
            raise ValueError(f"unknown GGUF layer tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[part]}.{suffix}"
    stem, _, suffix = gguf_name.rpartition(".")
    if stem not in _GLOBAL_TENSOR_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_TENSOR_NAMES[stem]}.{suffix}"


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of q/k projection rows (weights (rows, cols) or biases
    (rows,)): per head, rows stored as pairs (2i, 2i+1) go back to positions (i, i + d/2)."""
    rows = weight.shape[0]
    tail = weight.shape[1:]
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, *tail)
            .swapaxes(1, 2).reshape(rows, *tail).contiguous())


def dequantize_tensor(gguf: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    """One tensor as fp32 in torch (HF) shape, copied out of the file."""
    raw = gguf.raw_tensor_bytes(info)
    if info.ggml_type == GGMLQuantizationType.F32:
        array = np.array(raw.view(np.float32))  # copy: the memmap view is read-only
    elif info.ggml_type == GGMLQuantizationType.BF16:
        # widen bf16 to fp32 by shifting its bits into the high half
        array = (np.asarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif gguf_dequant.supports(info.ggml_type):  # whole-tensor torch path, same floats
        return gguf_dequant.dequantize_plain(raw, info.ggml_type).reshape(info.shape)
    else:
        array = dequantize(np.asarray(raw), info.ggml_type)
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(info.shape))


def iter_gguf_weights(gguf: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, fp32 tensor) for every tensor of the file, q/k back in HF layout."""
    arch = gguf_architecture(gguf)
    permuted = GGUF_ARCHITECTURES[arch][1]
    n_heads = int(gguf.metadata[f"{arch}.attention.head_count"])
    n_kv_heads = int(gguf.metadata.get(f"{arch}.attention.head_count_kv", n_heads))
    for gguf_name, info in gguf.tensors.items():
        hf_name = hf_tensor_name(gguf_name)
        if hf_name is None:
            continue
        tensor = dequantize_tensor(gguf, info)
        if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = unpermute_qk(tensor, n_heads)
        elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = unpermute_qk(tensor, n_kv_heads)
        yield hf_name, tensor


def gguf_cache_folder(gguf_path: str) -> Path:
    """Cache folder for what we derive from one GGUF file (config.json, tokenizer/)."""
    import tokenizers
    import transformers

    versions = f"transformers={transformers.__version__},tokenizers={tokenizers.__version__}"
    return file_cache_folder("gguf", gguf_path, versions)


def load_gguf_hf_config(gguf_path: str) -> dict[str, Any]:
    """`gguf_to_hf_config` of the file, read from the user cache when present (saves parsing
    the header, ~0.1 s), written there otherwise."""
    cached_path = gguf_cache_folder(gguf_path) / "config.json"
    config = read_cached_json(cached_path)
    if isinstance(config, dict):
        return config
    config = gguf_to_hf_config(read_gguf(gguf_path))
    write_json_atomically(cached_path, config)
    return config


def iter_gguf_file_weights(gguf_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_gguf_weights` of the file at `gguf_path` (picklable through functools.partial)."""
    yield from iter_gguf_weights(read_gguf(gguf_path))
