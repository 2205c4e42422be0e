"""Throughput-vs-latency curves from the JSON lines of `radixserve bench serving`.

`radixserve bench plot results.jsonl [more.jsonl ...] -o curves.png`: one panel per latency
metric (y), achieved throughput on x, one line per series (the record's "label", which defaults
to backend@base_url), points joined in order of request rate (all-at-once last).
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from typing import Any

from radixserve.bench.cli_support import (BenchError, existing_file, output_file,
                                          parse_json_lines, read_text, run_command)

DEFAULT_Y = ("median_ttft_ms", "median_tpot_ms", "p99_e2e_latency_ms")


def load_records(paths: list[str]) -> list[dict[str, Any]]:
    """Every JSON line of every file (BenchError naming the file and line of a bad one)."""
    records: list[dict[str, Any]] = []
    for path in paths:
        for number, record in enumerate(parse_json_lines(path, read_text(path)), 1):
            if not isinstance(record, dict):
                raise BenchError(f"{path}: record {number} is not a JSON object")
            records.append(record)
    return records


def check_keys(records: list[dict[str, Any]], keys: list[str]) -> None:
    """Each key must be in some record: one in none would only draw an empty panel."""
    missing = [key for key in keys if not any(key in rec for rec in records)]
    if missing:
        raise BenchError(f"no record has {', '.join(missing)}")


def group_series(records: list[dict[str, Any]], x_key: str,
                 y_key: str) -> dict[str, list[tuple[float, float]]]:
    """label -> [(x, y)] sorted by request rate; records missing x or y are skipped."""
    by_label: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
    for rec in records:
        rate = rec.get("request_rate")
        by_label[str(rec.get("label") or rec.get("backend"))].append(
            (math.inf if rate is None else float(rate), rec))
    series: dict[str, list[tuple[float, float]]] = {}
    for label, items in by_label.items():
        items.sort(key=lambda item: item[0])
        points = [(float(r[x_key]), float(r[y_key])) for _, r in items
                  if r.get(x_key) is not None and r.get(y_key) is not None]
        if points:
            series[label] = points
    return series


def plot(records: list[dict[str, Any]], output: str, x_key: str = "output_throughput",
         y_keys: tuple[str, ...] = DEFAULT_Y, title: str | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(y_keys), figsize=(5.5 * len(y_keys), 4.2), squeeze=False)
    for ax, y_key in zip(axes[0], y_keys):
        for label, points in sorted(group_series(records, x_key, y_key).items()):
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel(x_key.replace("_", " "))
        ax.set_ylabel(y_key.replace("_", " "))
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixserve bench plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=existing_file,
                        help="JSON-lines files from bench serving")
    parser.add_argument("-o", "--output", type=output_file, default="serving_curves.png")
    parser.add_argument("--x", default="output_throughput",
                        help="x key, e.g. output_throughput, request_throughput")
    parser.add_argument("--y", default=",".join(DEFAULT_Y),
                        help="comma-separated y keys, e.g. mean_ttft_ms,p99_itl_ms")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    return run_command(lambda: plot_files(args))


def plot_files(args: argparse.Namespace) -> int:
    records = load_records(args.files)
    if not records:
        raise BenchError("no records in " + ", ".join(args.files))
    y_keys = tuple(k.strip() for k in args.y.split(",") if k.strip())
    if not y_keys:
        raise BenchError("--y names no key")
    check_keys(records, [args.x, *y_keys])
    plot(records, args.output, args.x, y_keys, args.title)
    print(f"wrote {args.output} ({len(records)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
