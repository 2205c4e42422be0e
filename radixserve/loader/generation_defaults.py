"""Default sampling parameters of a model: what a request that leaves them unset gets.

From an HF folder's generation_config.json (temperature, top_p, top_k, min_p,
repetition_penalty; do_sample false means greedy), as vLLM does. The bundled SmolLM2-135M
(Q4_1) samples greedily by default: at temperature 1.0 its chat answers wander, greedy it answers
short questions sensibly (README says so). Anything else: none (SamplingParams' own defaults).
"""
from __future__ import annotations

import json
import os
from typing import Any

from radixserve.loader.model_resolution import ResolvedModel

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
BUNDLED_DEFAULTS: dict[str, Any] = {"temperature": 0.0}


def _generation_config(resolved: ResolvedModel) -> dict[str, Any]:
    """An HF folder's generation_config.json, {} where there is none (or it is unreadable)."""
    if resolved.kind != "hf":
        return {}
    path = os.path.join(resolved.path, "generation_config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def generation_eos_token_ids(resolved: ResolvedModel) -> list[int]:
    """The EOS ids generation_config.json lists (instruct checkpoints often put their
    end-of-turn id there alone); vLLM and SGLang stop on them too."""
    eos = _generation_config(resolved).get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]


def generation_defaults(resolved: ResolvedModel) -> dict[str, Any]:
    if resolved.is_bundled:
        return dict(BUNDLED_DEFAULTS)
    config = _generation_config(resolved)
    if not config:
        return {}
    defaults = {k: config[k] for k in SAMPLING_KEYS
                if isinstance(config.get(k), (int, float)) and not isinstance(config[k], bool)}
    if config.get("do_sample") is False:
        defaults = {"temperature": 0.0, **{k: v for k, v in defaults.items()
                                           if k == "repetition_penalty"}}
    return defaults
