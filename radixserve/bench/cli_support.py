"""What the bench commands share on their command lines: argument types that reject a bad
value with argparse's one-line `error: ...` (exit status 2), and `run_command`, which ends a
command that fails (BenchError, exit status 1) or is interrupted (exit status 130) with one line
instead of a traceback."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any, Callable


class BenchError(Exception):
    """A failure to report as one line, `error: MESSAGE`, with exit status 1."""


def run_command(body: Callable[[], int]) -> int:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        # Ctrl-C ends the command at once: unwinding asyncio.run (cancelling every request
        # task, then waiting for them) could hang on one that does not end
        signal.signal(signal.SIGINT, _end_interrupted)
    try:
        return body()
    except BenchError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _end_interrupted(signum: int, frame: Any) -> None:
    sys.stdout.flush()
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"cannot read {path}: {exc}")


def parse_json_lines(path: str, text: str) -> list[Any]:
    """The values of the non-blank lines of `text` (read from `path`), one JSON value each."""
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except ValueError:
            raise BenchError(f"{path} line {number}: not valid JSON")
    return values


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = "int"  # argparse names the type when the text is not a number at all
    return parse


def fraction(text: str) -> float:
    """A float in [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def request_rate(text: str) -> float:
    """Requests/s: > 0, or inf for all at once."""
    value = float(text)
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def request_rates(text: str) -> list[float]:
    """Comma-separated request rates, e.g. "1,2,4,inf"."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("no rate given")
    try:
        return [request_rate(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of rates: {text!r}")


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text}")
    return value


def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def output_file(text: str) -> str:
    """A file to write, in a directory that exists (checked before the run, not after it)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"directory {folder} does not exist")
    return text
