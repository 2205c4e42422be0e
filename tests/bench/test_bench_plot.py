from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def _write_runs(path: Path) -> Path:
    path.write_text(json.dumps(_record("x", 1.0, 10.0, 1.0)) + "\n")
    return path


def _plot_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    assert plot.main(list(argv)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err.strip()


def test_a_line_that_is_not_json_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _write_runs(tmp_path / "runs.jsonl")
    path.write_text(path.read_text() + "\n{oops\n")
    out = tmp_path / "c.png"
    assert _plot_error(capsys, str(path), "-o", str(out)) == \
        f"error: {path} line 3: not valid JSON"
    assert not out.exists()


@pytest.mark.parametrize("flag,value", [("--x", "nope_tput"), ("--y", "median_ttft_ms,nope_ms")])
def test_a_key_no_record_has_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture,
                                         flag: str, value: str) -> None:
    path = _write_runs(tmp_path / "runs.jsonl")
    out = tmp_path / "c.png"
    assert _plot_error(capsys, str(path), "-o", str(out), flag, value) == \
        f"error: no record has {value.split(',')[-1]}"
    assert not out.exists()


@pytest.mark.parametrize("which", ["input", "output"])
def test_missing_files_and_folders_are_argument_errors(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture,
                                                      which: str) -> None:
    path = _write_runs(tmp_path / "runs.jsonl")
    argv = [str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "c.png")] \
        if which == "input" else [str(path), "-o", str(tmp_path / "no-dir" / "c.png")]
    with pytest.raises(SystemExit) as exit_info:
        plot.main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "radixserve bench plot: error: argument ")
