"""GGUF (llama.cpp) checkpoints as an HF-style config dict and HF-named fp32 tensors.

llama.cpp names tensors `token_embd`, `blk.N.attn_q`, ...; we rename them to the names the
transformers state dict of the same architecture uses (Llama, Qwen2, Qwen3, Gemma-2, and the MoE
families Mixtral, Qwen2-MoE, Qwen3-MoE: `gguf_moe.py`), so models load GGUF and safetensors the
same way. llama.cpp's stacked experts come out one HF-named tensor per expert.

Invariant on q/k: llama.cpp's converter permutes the rows of `attn_q` / `attn_k` of Llama models
so that each head's rotary pairs are interleaved (GPT-J style, pairs (2i, 2i+1)) instead of split
in halves (GPT-NeoX style, pairs (i, i + d/2)) as in HF checkpoints. `unpermute_qk` undoes it; the
weights we yield are in HF layout (Mixtral's too: llama.cpp writes it as "llama"). Qwen2, Qwen3,
their MoE forms and Gemma-2 run NeoX rope in llama.cpp too, so their rows are stored as in HF.

Invariant on Gemma norms: HF's GemmaRMSNorm scales by (1 + w); llama.cpp's converter stores w + 1
(in the checkpoint's dtype) so its plain RMSNorm applies it; we subtract 1 again, as transformers'
GGUF import does. The float32 round trip (w + 1) - 1 may differ from w by an ulp of w + 1.

Weights are deliberately not cached: dequantizing all of the bundled 135M model takes 0.7-1.5 s
on a 2-core CPU, and reading an fp32 safetensors copy instead (538 MB on disk, 1.35 s to write
once) takes 0.1-0.45 s: under a second saved per start, for half a gigabyte per model file.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from radixserve.loader import gguf_dequant
from radixserve.loader.cache_dir import file_cache_folder, read_cached_json, write_json_atomically
from radixserve.loader.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf
from radixserve.loader.gguf_moe import (EXPERT, MIXTRAL_LAYER_NAMES, QWEN2_MOE_SHARED_NAMES,
                                        QWEN_MOE_LAYER_NAMES, SHARED_EXPERT_GATE, MetaKey,
                                        legacy_mixtral_expert_name, llama_moe_config,
                                        qwen2moe_config, qwen3moe_config)

_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_LAYER_NAMES = {
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
_QWEN3_LAYER_NAMES = {
    **_LLAMA_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_QWEN2_MOE_LAYER_NAMES = {**_LLAMA_LAYER_NAMES, **QWEN_MOE_LAYER_NAMES, **QWEN2_MOE_SHARED_NAMES}
_QWEN3_MOE_LAYER_NAMES = {**_QWEN3_LAYER_NAMES, **QWEN_MOE_LAYER_NAMES}
# Gemma-2 norms its sublayers' inputs and outputs; llama.cpp's `ffn_norm` is the one before the MLP
_GEMMA2_LAYER_NAMES = {
    **_LLAMA_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Tensors llama.cpp writes that have no HF counterpart (rope_freqs: llama3 rope factors, which
# the HF config expresses through rope_scaling instead).
_SKIPPED_TENSORS = {"rope_freqs.weight"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _f32(value: float) -> float:
    """The shortest decimal that round-trips a float32 metadata value (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _gemma2_query_scalar(config: dict[str, Any]) -> int:
    """Gemma-2's query_pre_attn_scalar, which no GGUF key holds: llama.cpp (llama-model.cpp)
    scales queries of the 27B model (46 layers) by (hidden / heads) ** -0.5, of the others by
    head_dim ** -0.5, as the HF configs say (144 for 27B, 256 = head_dim for 2B and 9B)."""
    if config["num_hidden_layers"] == 46:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _gemma2_config(key: MetaKey, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma-2 hyperparameters beyond the common ones; the defaults are llama.cpp's for keys
    a file leaves out. llama.cpp windows the even layers (pattern 2), as HF's layer_types do."""
    layers = config["num_hidden_layers"]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": _f32(key("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": _f32(key("final_logit_softcapping", 30.0)),
        "sliding_window": int(key("attention.sliding_window", 4096)),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(layers)],
        "query_pre_attn_scalar": _gemma2_query_scalar(config),
    }


@dataclass(frozen=True)
class GGUFArchitecture:
    """How llama.cpp's converter wrote one architecture, and what undoes it."""

    hf_architecture: str
    layer_names: Mapping[str, str] = field(default_factory=lambda: _LLAMA_LAYER_NAMES)
    model_type: str = ""  # transformers' model_type, where it is not the GGUF architecture
    permuted_qk: bool = False  # q/k rows in GPT-J rope order (see unpermute_qk)
    norm_offset: float = 0.0  # what the converter added to every `*norm.weight`
    extra_config: Callable[[MetaKey, dict[str, Any]], dict[str, Any]] | None = None


# general.architecture -> how to read it. Mistral models need no entry: llama.cpp writes
# MistralForCausalLM as "llama"; its "mistral3" is Ministral-3 / Mistral-3 (llama-4 attention
# temperature scaling, not implemented here). Mixtral is "llama" with experts (its config says
# MixtralForCausalLM: llama_moe_config).
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", {**_LLAMA_LAYER_NAMES, **MIXTRAL_LAYER_NAMES},
                              permuted_qk=True, extra_config=llama_moe_config),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM"),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", _QWEN3_LAYER_NAMES),
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", _GEMMA2_LAYER_NAMES, norm_offset=1.0,
                               extra_config=_gemma2_config),
    "qwen2moe": GGUFArchitecture("Qwen2MoeForCausalLM", _QWEN2_MOE_LAYER_NAMES,
                                 model_type="qwen2_moe", extra_config=qwen2moe_config),
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", _QWEN3_MOE_LAYER_NAMES,
                                 model_type="qwen3_moe", extra_config=qwen3moe_config),
}


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
    spec = GGUF_ARCHITECTURES[arch]

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
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type or arch,
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
    if spec.extra_config is not None:
        config.update(spec.extra_config(key, config))
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


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The transformers state-dict name of a llama.cpp tensor of a file of architecture `arch`;
    None for tensors HF has not. Stacked experts (`ffn_*_exps`) get a name with an `{expert}`
    field (gguf_moe.EXPERT) for the expert id."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    legacy = legacy_mixtral_expert_name(gguf_name) if arch == "llama" else None
    if legacy is not None:
        return legacy
    match = _LAYER_NAME.match(gguf_name)
    if match:
        layer, part, suffix = match.groups()
        layer_names = GGUF_ARCHITECTURES[arch].layer_names
        if part not in layer_names:
            raise ValueError(f"unknown GGUF layer tensor {gguf_name!r} for architecture {arch!r}")
        return f"model.layers.{layer}.{layer_names[part]}.{suffix}"
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
    return _dequantize(gguf.raw_tensor_bytes(info), info.ggml_type, info.shape)


def dequantize_expert(gguf: GGUFFile, info: GGUFTensorInfo, expert: int) -> torch.Tensor:
    """Slab `expert` of a stacked [experts, rows, cols] tensor as fp32 [rows, cols]: the same
    floats as that slab of `dequantize_tensor` (quant blocks never cross rows), one expert's
    worth of memory at a time."""
    return _dequantize(gguf.raw_tensor_bytes(info)[expert], info.ggml_type, info.shape[1:])


def _dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]
                ) -> torch.Tensor:
    if ggml_type == GGMLQuantizationType.F32:
        array = np.array(raw.view(np.float32))  # copy: the memmap view is read-only
    elif ggml_type == GGMLQuantizationType.BF16:
        # widen bf16 to fp32 by shifting its bits into the high half
        array = (np.asarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif gguf_dequant.supports(ggml_type):  # whole-tensor torch path, same floats
        return gguf_dequant.dequantize_plain(raw, ggml_type).reshape(shape)
    else:
        array = dequantize(np.asarray(raw), ggml_type)
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(shape))


def _to_hf_layout(spec: GGUFArchitecture, hf_name: str, tensor: torch.Tensor,
                  n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Undo what the converter did to one tensor: the q/k row permutation, the norm offset,
    the squeezed shared-expert gate."""
    if spec.permuted_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_qk(tensor, n_heads)
    if spec.permuted_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_qk(tensor, n_kv_heads)
    if spec.norm_offset and hf_name.endswith("norm.weight"):
        return tensor - spec.norm_offset
    if hf_name.endswith(SHARED_EXPERT_GATE):
        return tensor.reshape(1, -1)
    return tensor


def iter_gguf_weights(gguf: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, fp32 tensor) for every tensor of the file, in HF layout."""
    arch = gguf_architecture(gguf)
    spec = GGUF_ARCHITECTURES[arch]
    n_heads = int(gguf.metadata[f"{arch}.attention.head_count"])
    n_kv_heads = int(gguf.metadata.get(f"{arch}.attention.head_count_kv", n_heads))
    for gguf_name, info in gguf.tensors.items():
        hf_name = hf_tensor_name(gguf_name, arch)
        if hf_name is None:
            continue
        if EXPERT in hf_name:  # [experts, rows, cols]: slab e is expert e's HF weight
            for expert in range(info.shape[0]):
                yield hf_name.replace(EXPERT, str(expert)), dequantize_expert(gguf, info, expert)
            continue
        tensor = dequantize_tensor(gguf, info)
        yield hf_name, _to_hf_layout(spec, hf_name, tensor, n_heads, n_kv_heads)


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
