"""Printing a benchmark's rows as a table and appending them as JSON lines."""
from __future__ import annotations

import json
from typing import Any

# (key in the row, column header, format of the value)
Column = tuple[str, str, str]


def format_table(rows: list[dict[str, Any]], columns: list[Column]) -> str:
    widths = [max(len(header), 10) for _, header, _ in columns]
    lines = ["  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths))]
    for row in rows:
        cells = []
        for (key, _, fmt), width in zip(columns, widths):
            value = row.get(key)
            cells.append(("-" if value is None else format(value, fmt)).rjust(width))
        lines.append("  ".join(cells))
    return "\n".join(lines)


def append_jsonl(path: str | None, rows: list[dict[str, Any]]) -> None:
    if not path:
        return
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
