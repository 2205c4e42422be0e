"""`load_model_source`: one entry point from (--model-path, --load-format) to config + weights.

A ModelSource says what the model looks like (HF config dict and the resolved ModelConfig),
where its weights come from (a callable yielding HF-named tensors, None for dummy weights), and
what `get_tokenizer` needs to build its tokenizer (None when the model ships none). Nothing
heavy happens here: weights are read only when `weights()` is iterated, so a ModelSource is cheap
to build in the server process and picklable to hand to scheduler processes.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.core.model_config import ModelConfig
from radixserve.loader.bin_loader import iter_bin_weights
from radixserve.loader.generation_defaults import generation_defaults, generation_eos_token_ids
from radixserve.loader.model_resolution import ResolvedModel, resolve_model_path
from radixserve.loader.safetensors_loader import iter_safetensors_weights, read_hf_config
from radixserve.loader.weight_files import (PYTORCH_BIN, SAFETENSORS, WeightFormat,
                                            weight_files, weight_format)

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")

WeightsFn = Callable[[], Iterator[tuple[str, torch.Tensor]]]
# an HF folder's weight format -> what yields its tensors
_READERS: dict[WeightFormat, Callable[[str], Iterator[tuple[str, torch.Tensor]]]] = {
    SAFETENSORS: iter_safetensors_weights, PYTORCH_BIN: iter_bin_weights,
}


@dataclass
class ModelSource:
    """A model ready to build.

    weights: called once per model build; yields (hf_name, tensor) pairs named like a
      transformers state dict ("model.layers.0.self_attn.q_proj.weight", ...). GGUF tensors are
      fp32 (dequantized), safetensors and .bin tensors keep their stored dtype; the model
      casts. A tied checkpoint yields no "lm_head.weight" (model_config.tie_word_embeddings says
      so), or, as .bin files often do, a copy the model skips. None for "dummy": the model
      initialises itself (dummy_loader.init_dummy_weights).
    tokenizer_source: pass to `get_tokenizer`; None when the checkpoint has no tokenizer files.
    """

    hf_config: dict[str, Any]
    model_config: ModelConfig
    weights: WeightsFn | None
    tokenizer_source: ResolvedModel | None
    format: str  # "gguf" | "safetensors" | "pt" (pytorch_model*.bin) | "dummy"
    model_path: str  # the resolved file (gguf) or folder (hf)
    served_model_name: str
    # sampling parameters a request that leaves them unset gets (loader/generation_defaults.py)
    generation_defaults: dict[str, Any] = field(default_factory=dict)


def with_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The config with --json-model-override-args applied: a dict value merges into the
    config's dict of that key, key by key (nested dicts too), anything else replaces it; in
    a multimodal config (`text_config`, served text-only) a key its top level does not spell
    out goes to the text config, whose language model is what is served (num_hidden_layers
    or max_position_embeddings of Gemma-3 4b-27b, which its text_config may leave to the
    defaults)."""
    merged = dict(config)
    for key, value in overrides.items():
        target = merged
        text = merged.get("text_config")
        if isinstance(text, dict) and key not in merged:
            target = merged["text_config"] = dict(text)
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            target[key] = with_overrides(target[key], value)
        else:
            target[key] = value
    return merged


def _gguf_source(resolved: ResolvedModel, load_format: str,
                 overrides: dict[str, Any]) -> ModelSource:
    # imported here: the safetensors and dummy paths must not need the gguf package
    from radixserve.loader.gguf_loader import iter_gguf_file_weights, load_gguf_hf_config
    if load_format == "safetensors":
        raise ValueError(f"--load-format safetensors needs an HF folder, got GGUF {resolved.path}")
    hf_config = with_overrides(load_gguf_hf_config(resolved.path), overrides)
    dummy = load_format == "dummy"
    return ModelSource(
        hf_config=hf_config,
        model_config=ModelConfig.from_hf_dict(hf_config),
        weights=None if dummy else functools.partial(iter_gguf_file_weights, resolved.path),
        tokenizer_source=resolved,
        format="dummy" if dummy else "gguf",
        model_path=resolved.path,
        served_model_name=resolved.name,
        generation_defaults=generation_defaults(resolved),
    )


def _hf_folder_source(resolved: ResolvedModel, load_format: str,
                      overrides: dict[str, Any]) -> ModelSource:
    if load_format == "gguf":
        raise ValueError(f"--load-format gguf needs a .gguf file, got folder {resolved.path}")
    hf_config = with_overrides(read_hf_config(resolved.path), overrides)
    fmt = None if load_format == "dummy" else _folder_weight_format(resolved.path, load_format)
    model_config = ModelConfig.from_hf_dict(hf_config)
    extra_eos = set(generation_eos_token_ids(resolved)) - set(model_config.eos_token_ids)
    model_config.eos_token_ids = model_config.eos_token_ids + sorted(extra_eos)
    return ModelSource(
        hf_config=hf_config,
        model_config=model_config,
        weights=None if fmt is None else functools.partial(_READERS[fmt], resolved.path),
        tokenizer_source=resolved if resolved.has_tokenizer_files else None,
        format="dummy" if fmt is None else fmt.name,
        model_path=resolved.path,
        served_model_name=resolved.name,
        generation_defaults=generation_defaults(resolved),
    )


def _folder_weight_format(folder: str, load_format: str) -> WeightFormat:
    """The format of an HF folder's weights (weight_files.weight_format); FileNotFoundError
    where it has none (or none of the format --load-format names), CheckpointError where its
    index names files it lacks."""
    fmt = weight_format(folder)
    if load_format == "safetensors" and fmt is not None and fmt is not SAFETENSORS:
        raise FileNotFoundError(
            f"{folder} has no *.safetensors weights (--load-format safetensors), only "
            f"{fmt.file_glob} files; run with --load-format auto to read them")
    if fmt is None or not weight_files(folder, fmt):
        raise FileNotFoundError(
            f"{folder} has config.json but no *.safetensors or pytorch_model*.bin weights; add "
            "them, or run with --load-format dummy for random weights")
    return fmt


def load_model_source(model_path: str | None, load_format: str = "auto",
                      overrides: dict[str, Any] | None = None) -> ModelSource:
    """Resolve `model_path` (see model_resolution) and describe how to load it.

    overrides: --json-model-override-args, applied to the config as `with_overrides` says.

    load_format: "auto" (GGUF for .gguf; for HF folders safetensors, else pytorch_model*.bin),
    "gguf", "safetensors" (refuses a folder of .bin weights), or "dummy" (config only:
    config.json of a folder, or a GGUF's metadata; no weights read).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown --load-format {load_format!r}; choose from {LOAD_FORMATS}")
    resolved = resolve_model_path(model_path)
    if resolved.kind == "gguf":
        return _gguf_source(resolved, load_format, overrides or {})
    return _hf_folder_source(resolved, load_format, overrides or {})
