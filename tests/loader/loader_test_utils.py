"""Helpers for loader tests: tiny HF Llama models, HF folders with pytorch_model*.bin weights,
and GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them (gguf's own
tensor-name map, the Llama q/k row permutation, the Gemma norm offset, the hyperparameter keys
each architecture's converter class writes)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, get_tensor_name_map
from gguf.constants import MODEL_ARCH_NAMES, GGMLQuantizationType
from gguf.quants import quantize

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

TINY_LLAMA = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
)


def make_tiny_llama(tie_word_embeddings: bool = False, seed: int = 0) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, tie_word_embeddings=tie_word_embeddings))
    with torch.no_grad():  # norms away from 1 so a swapped norm would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def write_bin_twin(folder: Path, twin: Path, max_shard_size: str | None = None) -> Path:
    """Copy the HF safetensors folder `folder` to `twin` with its weights as .bin files, as
    transformers 4's save_pretrained(safe_serialization=False) wrote them (transformers 5 writes
    safetensors only): the same tensors, a tied embedding's "lm_head.weight" alias kept,
    `pytorch_model.bin`, or with `max_shard_size` `pytorch_model-0000X-of-0000N.bin` shards and
    `pytorch_model.bin.index.json` (huggingface_hub's writer, which transformers 4 used)."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    shutil.copytree(folder, twin, ignore=shutil.ignore_patterns("*.safetensors*"))
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(path))
    if json.loads((folder / "config.json").read_text()).get("tie_word_embeddings"):
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    save_torch_state_dict(state, twin, safe_serialization=False,
                          max_shard_size=max_shard_size or "5GB")
    return twin


def assert_a_lost_shard_is_named(sharded: Path, shard_glob: str, tmp_path: Path) -> None:
    """A copy of the sharded HF folder without the second of its `shard_glob` shards, which its
    index names, fails to load with one CheckpointError naming that shard."""
    from radixserve.loader.checkpoint_error import CheckpointError
    from radixserve.loader.model_source import load_model_source

    folder = tmp_path / "ckpt"
    shutil.copytree(sharded, folder)
    lost = sorted(folder.glob(shard_glob))[1]
    lost.unlink()
    with pytest.raises(CheckpointError, match=f"not there: {lost.name}"):
        load_model_source(str(folder))


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows (GPT-J rope layout)."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _rope_theta(config: dict[str, Any]) -> float:
    return config.get("rope_theta") or config["rope_parameters"]["rope_theta"]


def _add_shape_hparams(writer: GGUFWriter, config: dict[str, Any]) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])


def _add_text_model_hparams(writer: GGUFWriter, config: dict[str, Any]) -> None:
    """What TextModel.set_gguf_parameters writes (all the Qwen2 / Qwen3 converters write)."""
    _add_shape_hparams(writer, config)
    writer.add_rope_freq_base(_rope_theta(config))


def _add_llama_hparams(writer: GGUFWriter, config: dict[str, Any]) -> None:
    _add_text_model_hparams(writer, config)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])


def _add_gemma2_hparams(writer: GGUFWriter, config: dict[str, Any]) -> None:
    """Gemma2Model.set_gguf_parameters: no rope base (llama.cpp's default 10000 applies)."""
    _add_shape_hparams(writer, config)
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])


_HPARAM_WRITERS: dict[str, Callable[[GGUFWriter, dict[str, Any]], None]] = {
    "llama": _add_llama_hparams, "qwen2": _add_text_model_hparams,
    "qwen3": _add_text_model_hparams, "gemma2": _add_gemma2_hparams,
}


def _add_vocab(writer: GGUFWriter, config: dict[str, Any]) -> None:
    """A placeholder vocabulary: every real GGUF has one, and readers size the model from it."""
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(config["vocab_size"])])
    for name in ("bos", "eos", "pad"):
        if config.get(f"{name}_token_id") is not None:
            getattr(writer, f"add_{name}_token_id")(config[f"{name}_token_id"])


def llama_cpp_tensors(arch: str, state_dict: dict[str, torch.Tensor], config: dict[str, Any]
                      ) -> Iterator[tuple[str, np.ndarray]]:
    """(llama.cpp name, float32 array) as the converter makes them: named by gguf's own map,
    q/k rows permuted for Llama, Gemma norms stored as w + 1, Gemma's tied lm_head left out."""
    model_arch = {name: key for key, name in MODEL_ARCH_NAMES.items()}[arch]
    name_map = get_tensor_name_map(model_arch, config["num_hidden_layers"])
    for hf_name, tensor in state_dict.items():
        if arch == "gemma2" and hf_name == "lm_head.weight":
            continue
        array = tensor.detach().float().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config["num_attention_heads"])
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config["num_key_value_heads"])
        elif arch == "gemma2" and hf_name.endswith("norm.weight"):
            array = array + np.float32(1)
        yield name_map.get_name(hf_name, try_suffixes=(".weight", ".bias")), array


def write_gguf(arch: str, state_dict: dict[str, torch.Tensor], config: dict[str, Any],
               path: Path, quant: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """Write an HF state dict of architecture `arch` ("llama", "qwen3", "gemma2", ...) as
    llama.cpp would: 2-D weights in `quant`, 1-D tensors F32. `config` is the HF config as a
    dict; non-llama files get a placeholder vocabulary of `vocab_size` tokens."""
    tensors = ((name, array, array.ndim == 2)
               for name, array in llama_cpp_tensors(arch, state_dict, config))
    return write_gguf_tensors(arch, config, path, tensors, quant)


def write_gguf_tensors(arch: str, config: dict[str, Any], path: Path,
                       tensors: Iterable[tuple[str, np.ndarray, bool]],
                       quant: GGMLQuantizationType = GGMLQuantizationType.F32,
                       add_keys: Callable[[GGUFWriter], None] | None = None) -> Path:
    """A GGUF of architecture `arch` with the config's hyperparameters (architectures without
    a writer of their own: the plain text-model keys), a placeholder vocabulary off llama,
    the keys `add_keys` adds, and `tensors` as (llama.cpp name, array, quantised?): those
    marked quantised in `quant`, the rest as they are."""
    writer = GGUFWriter(str(path), arch)
    _HPARAM_WRITERS.get(arch, _add_text_model_hparams)(writer, config)
    if arch != "llama":
        _add_vocab(writer, config)
    if add_keys is not None:
        add_keys(writer)
    for name, array, quantised in tensors:
        if quantised and quant != GGMLQuantizationType.F32:
            writer.add_tensor(name, quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_llama_gguf(state_dict: dict[str, torch.Tensor], config: dict[str, Any], path: Path,
                     quant: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """`write_gguf` for an HF Llama state dict, hyperparameters under the `llama.` keys."""
    return write_gguf("llama", state_dict, config, path, quant)
