"""The generic weight loader: checkpoint tensors (HF names) into a model's parameters.

A model's parameters are named as in the transformers state dict, except where the model merges
several checkpoint tensors into one parameter; it lists those in `packed_modules_mapping`
(checkpoint module name -> (merged module name, shard id)), e.g. "q_proj" -> ("qkv_proj", "q").
Each parameter loads itself through its `weight_loader(param, tensor[, shard_id])` (a slice for a
tensor-parallel shard, an offset in a merged weight, a row of stacked experts; a loader given a
tensor of several shards returns the set it loaded); parameters
without one are copied whole. A model may also define `skip_weight(name) -> bool` for checkpoint
tensors it has no place for on purpose (rotary tables, a tied LM head's copy), and
`checkpoint_prefixes` (checkpoint name prefix -> parameter name prefix, the first that matches
renames) where its checkpoints keep the decoder under another name (a multimodal checkpoint's
language model, served text-only: "language_model.model." -> "model."); `skip_weight` and the
rest see the renamed name, errors name the checkpoint's.

Every parameter must be loaded (every shard of a merged one), and every checkpoint tensor must
find a parameter: a mismatch is an error naming the tensor, never a silently random weight.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable

import torch
from torch import nn

from radixserve.core.progress import progress
from radixserve.layers.linear import default_weight_loader
from radixserve.loader.checkpoint_error import CheckpointError


def _checkpoint_names(param_name: str, mapping: dict[str, tuple[str, object]],
                      prefixes: dict[str, str] | None = None) -> str:
    """A parameter as the checkpoint names it: a merged one by the tensors it is made of
    ("model.layers.0.mlp.{gate_proj,up_proj}.weight"), others as they are, under the first
    checkpoint prefix renamed to its prefix (`checkpoint_prefixes`)."""
    for old, new in (prefixes or {}).items():
        if param_name.startswith(new):
            param_name = old + param_name[len(new):]
            break
    parts = param_name.split(".")
    for i, part in enumerate(parts):
        pieces = sorted(ckpt for ckpt, (merged, _) in mapping.items() if merged == part)
        if pieces:
            return ".".join(parts[:i] + ["{" + ",".join(pieces) + "}"] + parts[i + 1:])
    return param_name


def _packed_target(name: str, mapping: dict[str, tuple[str, object]]
                   ) -> tuple[str, object] | None:
    """(parameter name, shard id) when `name` belongs to a merged parameter."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in mapping:
            merged, shard_id = mapping[part]
            return ".".join(parts[:i] + [merged] + parts[i + 1:]), shard_id
    return None


def renamed(name: str, prefixes: dict[str, str]) -> str:
    """A checkpoint tensor's name with the first of `prefixes` it starts with replaced."""
    for old, new in prefixes.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


# per-layer KV cache scales of FP8 checkpoints (compressed-tensors / ModelOpt naming)
_KV_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(?:[a-z_]+\.)?(k|v|kv)_scale$")


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Also collects per-layer KV cache scales into `model.kv_cache_scales` (layer ->
    {"k": float, "v": float}) for an FP8 KV pool."""
    params = dict(model.named_parameters())
    kv_scales: dict[int, dict[str, float]] = {}
    model.kv_cache_scales = kv_scales  # type: ignore[assignment]
    weights = progress(weights, "loading weights", "tensor")
    mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    skip = getattr(model, "skip_weight", None)
    weight_target = getattr(model, "weight_target", None)
    prefixes: dict[str, str] = getattr(model, "checkpoint_prefixes", {})
    # merged parameter -> the shard ids it still expects
    expected_shards = {params_name: set(getattr(param, "expected_shards", ()))
                       for params_name, param in params.items()}
    for ckpt_module, (merged, shard_id) in mapping.items():
        for params_name in params:
            if f".{merged}." in f".{params_name}":
                expected_shards[params_name].add(shard_id)
    loaded: dict[str, set[object]] = defaultdict(set)
    for checkpoint_name, tensor in weights:
        name = renamed(checkpoint_name, prefixes)
        if skip is not None and skip(name):
            continue
        kv_scale = _KV_SCALE_NAME.search(name)
        if kv_scale is not None and name not in params:
            layer, which = int(kv_scale.group(1)), kv_scale.group(2)
            for part in ("k", "v") if which == "kv" else (which,):
                kv_scales.setdefault(layer, {})[part] = float(tensor.float().max())
            continue
        if name.endswith(".weight_scale_inv"):  # block FP8: the same dequantising multiplier
            name = name[:-len("_inv")]
        packed = weight_target(name) if weight_target is not None else None
        if packed is None:
            packed = _packed_target(name, mapping)
        target, shard_id = packed if packed is not None else (name, None)
        param = params.get(target)
        if param is None:
            raise CheckpointError(f"checkpoint tensor {checkpoint_name!r} has no place in "
                                  f"{type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        covered = None
        try:
            if shard_id is not None:
                assert loader is not None, f"{target} is merged but has no weight_loader"
                covered = loader(param, tensor, shard_id)
            elif loader is not None:
                loader(param, tensor)
            else:
                default_weight_loader(param, tensor)
        except ValueError as exc:
            raise CheckpointError(f"{checkpoint_name}: {exc}") from exc
        # a tensor holding several shards (all experts in one): the loader says which
        loaded[target].update(covered if isinstance(covered, set) else {shard_id})
    missing = sorted(n for n, p in params.items()
                     if n not in loaded and not getattr(p, "optional", False))
    if missing:
        names = [_checkpoint_names(n, mapping, prefixes) for n in missing[:4]]
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {names}")
    partial = sorted(n for n, want in expected_shards.items() if want - loaded[n]
                     and not getattr(params[n], "optional", False))
    if partial:
        lacking = sorted(map(str, expected_shards[partial[0]] - loaded[partial[0]]))
        raise CheckpointError(f"checkpoint lacks pieces of merged parameters, e.g. "
                              f"{_checkpoint_names(partial[0], mapping, prefixes)} misses "
                              f"{lacking}")
