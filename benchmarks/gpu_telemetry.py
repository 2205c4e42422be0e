"""Summarise the GPU's clocks and power over a benchmark run: was it held by the power cap?

    python3 benchmarks/gpu_telemetry.py LOG [--busy-watts 200]

LOG holds nvidia-smi's CSV samples, one per second, as gpu_common.sh's telemetry_start writes
them (`nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,
clocks_event_reasons.active --format=csv,noheader`). Over the busy samples (power above
--busy-watts: the run, not the model loading) it prints the SM clock's median and range, the
power's median and the share of samples whose active clock reasons include the software power
cap (bit 0x4). An H200 at its 700 W limit ran the FP8 KV offline run at 1,455-1,605 MHz
(1,980 at rest), so compute-bound kernels there run ~20% below their burst speed.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


@dataclass
class Sample:
    sm_mhz: float
    watts: float
    reasons: int


@dataclass
class Summary:
    samples: int
    busy: int
    sm_mhz_median: float
    sm_mhz_min: float
    sm_mhz_max: float
    watts_median: float
    power_capped_share: float

    def line(self) -> str:
        if not self.busy:
            return f"{self.samples} samples, none busy"
        return (f"{self.busy} busy samples of {self.samples}: SM clock median "
                f"{self.sm_mhz_median:.0f} MHz ({self.sm_mhz_min:.0f}-{self.sm_mhz_max:.0f}), "
                f"power median {self.watts_median:.0f} W, power-capped in "
                f"{100 * self.power_capped_share:.0f}% of them")


def _number(field: str) -> float:
    return float(field.strip().split()[0])  # "1590 MHz", "692.06 W"


def parse(lines: list[str]) -> list[Sample]:
    """The samples of nvidia-smi's CSV rows; rows that are not samples (errors, a row cut off
    when the sampler was stopped) are skipped."""
    samples = []
    for line in lines:
        fields = line.split(",")
        if len(fields) != 6:
            continue
        try:
            samples.append(Sample(_number(fields[1]), _number(fields[3]),
                                  int(fields[5].strip(), 16)))
        except ValueError:
            continue
    return samples


def summarise(samples: list[Sample], busy_watts: float = 200.0) -> Summary:
    busy = [s for s in samples if s.watts > busy_watts]
    if not busy:
        return Summary(len(samples), 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    clocks = [s.sm_mhz for s in busy]
    return Summary(len(samples), len(busy), statistics.median(clocks), min(clocks), max(clocks),
                   statistics.median(s.watts for s in busy),
                   sum(1 for s in busy if s.reasons & SW_POWER_CAP) / len(busy))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--busy-watts", type=float, default=200.0)
    args = parser.parse_args()
    lines = args.log.read_text().splitlines() if args.log.exists() else []
    print(f"   telemetry: {summarise(parse(lines), args.busy_watts).line()}")


if __name__ == "__main__":
    main()
