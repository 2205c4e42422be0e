"""compressed-tensors checkpoints' `quantization_config`, read with the compressed-tensors
library: the one config group radixserve serves (FP8 float weights, fp8.py; int4 pack-quantized
weights, int4.py), and its act-order setting."""
from __future__ import annotations

import copy
from typing import Any


def single_scheme(raw: dict[str, Any]) -> tuple[Any, Any, bool]:
    """(the validated QuantizationConfig, its one config group's QuantizationScheme, whether
    that group declares act-order that keeps each input feature's group in `weight_g_idx`:
    "group", or its older spellings "dynamic" and true). Older llm-compressor releases wrote
    those, which the library no longer validates, so act-order is read here and left out of
    validation ("weight" act-order keeps groups contiguous: no g_idx)."""
    from compressed_tensors.quantization import QuantizationConfig
    raw = copy.deepcopy(raw)
    orders = {str((group.get("weights") or {}).pop("actorder", None)).lower()
              for group in (raw.get("config_groups") or {}).values() if isinstance(group, dict)}
    config = QuantizationConfig.model_validate(raw)
    groups = list(config.config_groups.values())
    if len(groups) != 1:
        raise ValueError("compressed-tensors checkpoints with several config groups are not "
                         "supported")
    return config, groups[0], bool(orders & {"group", "dynamic", "true"})
