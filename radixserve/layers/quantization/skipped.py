"""The linear layers a quantised checkpoint leaves unquantised (`Fp8Config.skipped`,
`Int4Config.skipped`).

Checkpoints name them by substrings of their module names (transformers' reading of
`modules_to_not_convert`: "lm_head", "linear_attn.in_proj_ba", "mlp.gate") or by "re:" regular
expressions (compressed-tensors' `ignore`), in the checkpoint's own names. A layer built FP8 is
turned back into a plain one before loading when every checkpoint module it is made of is
skipped: a merged layer's pieces (`packed_modules_mapping`), each under any of the model's
checkpoint prefixes (a multimodal checkpoint's language model). Pieces of one merged layer
skipped and not skipped cannot share its storage: that checkpoint is refused.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from radixserve.layers.linear import LinearBase
from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.quantization.fp8 import Fp8Config
from radixserve.layers.quantization.int4 import Int4Config
from radixserve.layers.quantization.int4_linear import drop_int4_params


def _matches(entry: str, name: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry in name


def _checkpoint_modules(name: str, mapping: dict[str, tuple[str, object]],
                        prefixes: dict[str, str]) -> list[list[str]]:
    """For each checkpoint module a layer is made of, the names it may have there."""
    head, _, last = name.rpartition(".")
    pieces = [ckpt for ckpt, (merged, _) in mapping.items() if merged == last] or [last]
    variants = []
    for piece in pieces:
        full = f"{head}.{piece}" if head else piece
        names = [full] + [old + full[len(new):] for old, new in prefixes.items()
                          if full.startswith(new)]
        variants.append(names)
    return variants


def keep_unquantized(model: nn.Module, config: Fp8Config | Int4Config | None) -> list[str]:
    """Make the skipped layers of a just-built model plain ones (compute dtype, no scales);
    returns their names."""
    if config is None or not config.skipped:
        return []
    mapping = getattr(model, "packed_modules_mapping", {})
    prefixes = getattr(model, "checkpoint_prefixes", {})
    kept = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and module.int4 is not None:
            if _experts_skipped(name, module, config):
                module.keep_unquantized()
                kept.append(name)
            continue
        if not isinstance(module, LinearBase) or (module.fp8 is None and module.int4 is None):
            continue
        skipped = [any(_matches(entry, n) for entry in config.skipped for n in names)
                   for names in _checkpoint_modules(name, mapping, prefixes)]
        if not any(skipped):
            continue
        if not all(skipped):
            raise ValueError(f"{name}: the checkpoint quantises some of the modules merged "
                             "into it and leaves others unquantised")
        _make_plain(module)
        kept.append(name)
    return kept


_EXPERT_PIECES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _experts_skipped(name: str, moe: FusedMoE, config: Fp8Config | Int4Config) -> bool:
    """Whether the checkpoint leaves every routed expert of `moe` unquantised (some but not
    all: refused), by its pieces' names in either naming (gate_proj / w1, ...)."""
    skipped = [any(_matches(entry, f"{name}.{e}.{piece}") for entry in config.skipped
                   for pieces in _EXPERT_PIECES for piece in pieces)
               for e in range(moe.num_experts)]
    if any(skipped) and not all(skipped):
        raise ValueError(f"{name}: the checkpoint quantises some of these experts and leaves "
                         "others unquantised")
    return all(skipped)


def _make_plain(layer: LinearBase) -> None:
    device = next(layer.parameters()).device
    weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size,
                                      dtype=torch.get_default_dtype(), device=device),
                          requires_grad=False)
    weight.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
    layer.weight = weight
    for scale in ("weight_scale", "input_scale"):
        if hasattr(layer, scale):
            delattr(layer, scale)
    if layer.int4 is not None:
        drop_int4_params(layer)
    layer.fp8 = None
    layer.int4 = None
    layer.group_k = None
