from __future__ import annotations

import json
from pathlib import Path

from radixserve.bench import plot


def _record(label: str, rate: float | None, tput: float, ttft: float | None) -> dict:
    return {"label": label, "request_rate": rate, "output_throughput": tput,
            "median_ttft_ms": ttft, "median_tpot_ms": 1.0, "p99_e2e_latency_ms": 9.0}


def test_series_are_grouped_and_ordered_by_rate() -> None:
    records = [_record("a", None, 30.0, 9.0), _record("a", 1.0, 10.0, 2.0),
               _record("b", 2.0, 15.0, 3.0), _record("a", 4.0, 20.0, 4.0),
               _record("b", 1.0, 12.0, None)]
    series = plot.group_series(records, "output_throughput", "median_ttft_ms")
    assert series == {"a": [(10.0, 2.0), (20.0, 4.0), (30.0, 9.0)], "b": [(15.0, 3.0)]}


def test_main_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    path.write_text("\n".join(json.dumps(_record(label, rate, 10.0 * i, 1.0 + i))
                              for i, (label, rate) in enumerate(
                                  [("x", 1.0), ("x", 2.0), ("y", 1.0), ("y", None)])) + "\n")
    out = tmp_path / "curves.png"
    assert plot.main([str(path), "-o", str(out), "--title", "t"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
