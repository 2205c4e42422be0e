"""The command line and Engine shared by the offline GPU probes (gpu_profile_offline.py,
gpu_sync_points.py): a dummy-weight bf16 Engine over --model-path, a workload of --num-prompts
prompts of --input-len tokens decoding --output-len, and any Engine flag as key=value."""
from __future__ import annotations

import argparse
from typing import Any


def workload_parser(default_prompts: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--num-prompts", type=int, default=default_prompts)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("engine_args", nargs="*", help="Engine flags as key=value")
    return parser


def engine_flags(items: list[str]) -> dict[str, Any]:
    """key=value -> {key: True/False/int/str}."""
    flags: dict[str, Any] = {}
    for item in items:
        key, value = item.split("=", 1)
        flags[key] = {"true": True, "false": False}.get(
            value, int(value) if value.isdigit() else value)
    return flags


def dummy_engine(args: argparse.Namespace) -> Any:
    import radixserve
    return radixserve.Engine(args.model_path, load_format="dummy", dtype="bfloat16",
                             skip_tokenizer_init=True, **engine_flags(args.engine_args))


def greedy_params(args: argparse.Namespace) -> dict[str, Any]:
    """Every request runs to --output-len tokens."""
    return {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
