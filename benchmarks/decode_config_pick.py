"""The labels `gpu_kernels.py --only decode` prints for decode-attention configs, and the pick of
its log that gpu_fp8.sh's attn_ab step runs: the fastest config at one batch size, as
RADIXSERVE_DECODE_CONFIG's value, printed only when it beats the FP8 pools' default config by the
given factor; nothing otherwise.

    python3 benchmarks/decode_config_pick.py LOG BATCH [FACTOR]
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from radixserve.attention.kernels.decode_attention import (  # noqa: E402
    DecodeKernelConfig, default_decode_config)

# the label: n{block_n}w{num_warps}s{num_stages}, then e (V with K), r{max_registers}, l (lazy
# rescale), k (first block before the PDL wait)
LABEL = r"n(\d+)w(\d+)s(\d+)(e?)(?:r(\d+))?(l?)(k?)"
LINE = re.compile(r"^decode bs=(\d+)\s+ctx=\d+\s+splits=(\d+)\*\s+" + LABEL + r"\s+([\d.]+) us")


def config_label(config: DecodeKernelConfig) -> str:
    return (f"n{config.block_n}w{config.num_warps}s{config.num_stages}"
            f"{'e' if config.early_v else ''}"
            f"{f'r{config.max_registers}' if config.max_registers else ''}"
            f"{'l' if config.lazy_rescale else ''}{'k' if config.early_kv else ''}")


def env_value(config: DecodeKernelConfig) -> str:
    """RADIXSERVE_DECODE_CONFIG's spelling of the config."""
    return (f"{config.block_n},{config.num_warps},{config.num_stages},{int(config.early_v)},"
            f"{config.max_registers},{int(config.lazy_rescale)},{int(config.early_kv)}")


def pick(lines: list[str], batch: int, factor: float) -> str:
    default = None  # the FP8 default at the batch's split plan
    times: dict[DecodeKernelConfig, float] = {}
    for line in lines:
        match = LINE.match(line)
        if not match or int(match.group(1)) != batch:
            continue
        splits, block_n, warps, stages, early, registers, lazy, early_kv, micros = \
            match.groups()[1:]
        default = default_decode_config(torch.float8_e4m3fn, int(splits))
        config = DecodeKernelConfig(int(block_n), int(warps), int(stages), bool(early),
                                    int(registers or 0), bool(lazy), bool(early_kv))
        times[config] = min(float(micros), times.get(config, float("inf")))
    if default is None or default not in times:
        return ""
    best = min(times, key=times.__getitem__)
    if best == default or times[best] >= factor * times[default]:
        return ""
    return env_value(best)


def main() -> None:
    path, batch = sys.argv[1], int(sys.argv[2])
    factor = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
    with open(path) as log:
        print(pick(log.readlines(), batch, factor))


if __name__ == "__main__":
    main()
