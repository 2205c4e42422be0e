"""A LoRA adapter folder as PEFT saves it: adapter_config.json (r, lora_alpha, target_modules,
use_rslora) and adapter_model.safetensors (or adapter_model.bin), whose tensors are named
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r].

What PEFT can save and this server cannot apply is refused by name: DoRA, per-module ranks or
alphas, trained biases, modules saved whole (modules_to_save), embedding adapters, the
fan-in-fan-out layout (GPT-2's Conv1D).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.loader.bin_loader import read_state_dict
from radixserve.loader.checkpoint_error import CheckpointError

PEFT_PREFIX = "base_model.model."
_KINDS = {"lora_A": 0, "lora_B": 1}


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    # checkpoint module name (e.g. "model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r])
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_lora_adapter(name: str, path: str) -> LoRAAdapter:
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise CheckpointError(f"LoRA adapter {name!r}: no adapter_config.json in {path}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"LoRA adapter {name!r}: unreadable adapter_config.json in "
                              f"{path}: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"LoRA adapter {name!r}: adapter_config.json in {path} is not "
                              "a JSON object")
    _check_config(name, config)
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", 8))  # PEFT's LoraConfig default
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, list[torch.Tensor | None]] = {}
    for tensor_name, tensor in _tensors(name, folder):
        module, kind = _module_and_kind(name, tensor_name)
        pairs.setdefault(module, [None, None])[_KINDS[kind]] = tensor
    modules = {}
    for module, (a, b) in pairs.items():
        if a is None or b is None:
            raise CheckpointError(f"LoRA adapter {name!r}: {module} has only one of lora_A "
                                  "and lora_B")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise CheckpointError(f"LoRA adapter {name!r}: {module}'s lora_A {tuple(a.shape)} "
                                  f"/ lora_B {tuple(b.shape)} are not of rank r = {rank}")
        modules[module] = (a, b)
    if not modules:
        raise CheckpointError(f"LoRA adapter {name!r} in {path} holds no lora_A / lora_B "
                              "tensors")
    return LoRAAdapter(name, rank, scale, modules)


def _check_config(name: str, config: dict) -> None:
    refused = {
        "use_dora": "DoRA", "rank_pattern": "per-module ranks",
        "alpha_pattern": "per-module alphas", "modules_to_save": "modules saved whole",
        "fan_in_fan_out": "the fan-in-fan-out layout"}
    for key, what in refused.items():
        if config.get(key):
            raise CheckpointError(f"LoRA adapter {name!r}: {what} ({key}) is not supported")
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is "
                              "not LORA")
    if config.get("bias", "none") != "none":
        raise CheckpointError(f"LoRA adapter {name!r}: trained biases (bias="
                              f"{config['bias']!r}) are not supported")
    if not isinstance(config.get("r"), int) or config["r"] <= 0:
        raise CheckpointError(f"LoRA adapter {name!r}: adapter_config.json needs a positive r")


def _tensors(name: str, folder: Path):
    safetensors_file = folder / "adapter_model.safetensors"
    bin_file = folder / "adapter_model.bin"
    if safetensors_file.is_file():
        from safetensors.torch import load_file
        yield from load_file(str(safetensors_file)).items()
    elif bin_file.is_file():
        yield from read_state_dict(str(bin_file)).items()
    else:
        raise CheckpointError(f"LoRA adapter {name!r}: no adapter_model.safetensors or "
                              f"adapter_model.bin in {folder}")


def _module_and_kind(name: str, tensor_name: str) -> tuple[str, str]:
    """("model.layers.0.self_attn.q_proj", "lora_A") of a PEFT tensor name (an adapter name
    between the kind and "weight", as some saves keep it, is allowed)."""
    parts = tensor_name.removeprefix(PEFT_PREFIX).split(".")
    for i, part in enumerate(parts):
        if part in _KINDS and parts[-1] == "weight" and i >= 1:
            return ".".join(parts[:i]), part
    raise CheckpointError(f"LoRA adapter {name!r}: tensor {tensor_name!r} is not a lora_A / "
                          "lora_B weight (embedding adapters and trained biases are not "
                          "supported)")
