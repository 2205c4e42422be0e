"""The weight shapes a Llama-style model's decode step multiplies by, on one tensor-parallel rank:
what the GEMM sweeps (gpu_gemm_tune.py, gpu_row_fusion.py, gpu_fp8_mma.py) time and write
tables for, keyed (as the kernels look them up) by the rank's local [N, K].

    python3 benchmarks/model_shapes.py benchmarks/configs/llama-3.1-70b --tp-size 8

The splits follow radixserve/layers: q|k|v by heads (KV heads replicated when there are fewer
than ranks), o and down by their input columns, gate|up by rows, the LM head by vocabulary rows
padded to a multiple of the rank count.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent / "configs" / "llama-3.1-8b"


def decode_product_shapes(model_path: str | Path = DEFAULT_MODEL, tp_size: int = 1
                          ) -> dict[str, tuple[int, int]]:
    """{"qkv", "o", "gate_up", "down", "lm_head"} -> (N, K) on one of tp_size ranks (MoE
    models: gate_up / down are those of `intermediate_size`, Llama-4's shared expert)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    config = config.get("text_config") or config  # a multimodal checkpoint's language model
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    kv_heads = kv_heads or heads
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]
    for name, total in (("attention heads", heads), ("intermediate size", inter)):
        if total % tp_size:
            raise ValueError(f"{name} {total} do not split over {tp_size} ranks")
    local_kv = max(1, kv_heads // tp_size)
    return {
        "qkv": ((heads // tp_size + 2 * local_kv) * head_dim, hidden),
        "o": (hidden, heads // tp_size * head_dim),
        "gate_up": (2 * inter // tp_size, hidden),
        "down": (hidden, inter // tp_size),
        "lm_head": (-(-vocab // tp_size), hidden),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_path", nargs="?", default=str(DEFAULT_MODEL))
    parser.add_argument("--tp-size", type=int, default=1)
    args = parser.parse_args()
    for name, (n, k) in decode_product_shapes(args.model_path, args.tp_size).items():
        print(f"{name:8} N={n:<7} K={k}")


if __name__ == "__main__":
    main()
