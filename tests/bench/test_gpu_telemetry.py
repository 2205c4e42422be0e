"""gpu_telemetry.py: nvidia-smi samples -> busy clocks, power and the power-cap share."""
from __future__ import annotations

from benchmarks.gpu_telemetry import parse, summarise

# rows as the H200 wrote them in session 18's FP8 KV offline run (model loading, then the run),
# with an error row and the row cut off when the sampler was stopped
ROWS = """\
2026/12/03 14:42:57.986, 345 MHz, 3201 MHz, 78.85 W, 35, 0x0000000000000001
2026/12/03 14:43:06.260, 1980 MHz, 3201 MHz, 122.56 W, 36, 0x0000000000000000
2026/12/03 14:43:22.685, 1455 MHz, 3201 MHz, 691.35 W, 54, 0x0000000000000004
2026/12/03 14:43:43.278, 1590 MHz, 3201 MHz, 692.06 W, 54, 0x0000000000000004
2026/12/03 14:44:26.529, 1845 MHz, 3201 MHz, 684.45 W, 54, 0x0000000000000004
2026/12/03 14:44:41.984, 1965 MHz, 3201 MHz, 637.92 W, 54, 0x0000000000000000
Unable to determine the device handle for GPU0000:00:00.0: Unknown Error
2026/12/03 14:44:43.009, 1980 MH""".splitlines()


def test_busy_samples_and_power_cap_share() -> None:
    samples = parse(ROWS)
    assert len(samples) == 6  # the error row and the cut row are skipped
    summary = summarise(samples, busy_watts=200)
    assert (summary.samples, summary.busy) == (6, 4)
    assert summary.sm_mhz_median == (1590 + 1845) / 2
    assert (summary.sm_mhz_min, summary.sm_mhz_max) == (1455, 1965)
    assert summary.power_capped_share == 0.75
    assert "power-capped in 75%" in summary.line()


def test_no_busy_samples() -> None:
    summary = summarise(parse(ROWS[:2]))
    assert summary.busy == 0 and summary.line() == "2 samples, none busy"
