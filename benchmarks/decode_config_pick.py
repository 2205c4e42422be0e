"""The fastest decode-attention config of a `gpu_kernels.py --only decode` log at one batch size,
as RADIXSERVE_DECODE_CONFIG's value, printed only when it beats the FP8 pools' default config
(n64w2s3e) by the given factor; nothing otherwise.

    python3 benchmarks/decode_config_pick.py LOG BATCH [FACTOR]
"""
from __future__ import annotations

import re
import sys

LINE = re.compile(r"^decode bs=(\d+)\s+ctx=\d+\s+splits=\d+\*\s+"
                  r"n(\d+)w(\d+)s(\d+)(e?)(?:r(\d+))?\s+([\d.]+) us")
DEFAULT = (64, 2, 3, 1, 0)


def pick(lines: list[str], batch: int, factor: float) -> str:
    times: dict[tuple[int, ...], float] = {}
    for line in lines:
        match = LINE.match(line)
        if not match or int(match.group(1)) != batch:
            continue
        block_n, warps, stages, early, registers, micros = match.groups()[1:]
        config = (int(block_n), int(warps), int(stages), int(bool(early)), int(registers or 0))
        times[config] = min(float(micros), times.get(config, float("inf")))
    if not times or DEFAULT not in times:
        return ""
    best = min(times, key=times.__getitem__)
    if best == DEFAULT or times[best] >= factor * times[DEFAULT]:
        return ""
    return ",".join(str(v) for v in best)


def main() -> None:
    path, batch = sys.argv[1], int(sys.argv[2])
    factor = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
    with open(path) as log:
        print(pick(log.readlines(), batch, factor))


if __name__ == "__main__":
    main()
