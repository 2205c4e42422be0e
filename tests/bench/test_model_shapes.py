"""The decode products' per-rank shapes that the GEMM sweeps write tables for are the shapes the
tensor-parallel layers hold (built on the meta device, so nothing is allocated)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.model_shapes import decode_product_shapes
from radixserve.layers.linear import RowParallelLinear
from radixserve.layers.merged_linear import MergedColumnParallelLinear, QKVParallelLinear

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def _layer_shapes(config: dict, tp_size: int) -> dict[str, tuple[int, int]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    with torch.device("meta"):
        layers = {
            "qkv": QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp_rank=tp_size - 1,
                                     tp_size=tp_size),
            "o": RowParallelLinear(heads * head_dim, hidden, tp_rank=0, tp_size=tp_size),
            "gate_up": MergedColumnParallelLinear(hidden, [inter] * 2, tp_rank=0,
                                                  tp_size=tp_size),
            "down": RowParallelLinear(inter, hidden, tp_rank=0, tp_size=tp_size),
        }
    return {name: tuple(layer.weight.shape) for name, layer in layers.items()}


@pytest.mark.parametrize("model,tp_size", [("llama-3.1-8b", 1), ("llama-3.1-8b", 2),
                                           ("llama-3.1-70b", 2), ("llama-3.1-70b", 8),
                                           ("llama-3.1-405b", 8)])
def test_shapes_are_the_layers_shapes(model: str, tp_size: int) -> None:
    config = json.loads((CONFIGS / model / "config.json").read_text())
    shapes = decode_product_shapes(CONFIGS / model, tp_size)
    layer_shapes = _layer_shapes(config, tp_size)
    for name, shape in layer_shapes.items():
        assert shapes[name] == shape, name
    assert shapes["lm_head"] == (-(-config["vocab_size"] // tp_size), config["hidden_size"])


def test_llama_8b_shapes_are_the_swept_tables() -> None:
    assert decode_product_shapes() == {"qkv": (6144, 4096), "o": (4096, 4096),
                                       "gate_up": (28672, 4096), "down": (4096, 14336),
                                       "lm_head": (128256, 4096)}
    assert decode_product_shapes(CONFIGS / "llama-3.1-70b", 8)["qkv"] == (1280, 8192)
