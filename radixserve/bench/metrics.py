"""Per-request measurements and the serving metrics computed from them.

Definitions (times in seconds inside, milliseconds in reports):
  TTFT  time from sending the request to the first streamed token event.
  E2E   time from sending the request to the last byte of the response.
  TPOT  per request, (E2E - TTFT) / (output_len - 1); only for streamed requests with > 1 token.
  ITL   every gap between consecutive streamed token events, pooled over all requests. One event
        may carry several tokens (--stream-interval > 1), and its gap counts once.
Token counts come from what the server reported (usage / meta_info); a request whose reported
completion length differs from the length asked for is counted in `output_len_mismatches`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestOutput:
    success: bool = False
    prompt_len: int = 0  # as reported by the server (the dataset's length if it reported none)
    output_len: int = 0  # completion tokens reported by the server
    expected_output_len: int = 0  # what was asked for (max_new_tokens with ignore_eos)
    cached_tokens: int | None = None  # prompt tokens the server served from its prefix cache
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    streamed: bool = True
    generated_text: str = ""
    error: str = ""


@dataclass
class LatencyStats:
    """Milliseconds. NaN when there were no samples."""
    count: int
    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def from_seconds(cls, values: Sequence[float]) -> "LatencyStats":
        if len(values) == 0:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, PERCENTILES)  # linear interpolation between ranks
        return cls(len(values), float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    expected_output_tokens: int
    output_len_mismatches: int
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens / s
    output_throughput: float  # completion tokens / s
    total_throughput: float
    cache_hit_rate: float | None  # sum(cached_tokens) / sum(prompt tokens), if reported
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e_latency: LatencyStats
    errors: list[str] = field(default_factory=list)  # a few distinct failure messages

    def to_flat_dict(self) -> dict[str, Any]:
        """Flat JSON-ready dict: latency stats become keys like 'p99_ttft_ms'; NaN -> None."""
        flat: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if isinstance(value, dict) and "mean_ms" in value:
                for stat in ("mean", "median", "p90", "p99"):
                    flat[f"{stat}_{key}_ms"] = json_number(value[f"{stat}_ms"])
            else:
                flat[key] = json_number(value)
        return flat


def json_number(value: Any) -> Any:
    """NaN and infinities as None (JSON null): json.dumps would write bare NaN, not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def time_per_output_token(output: RequestOutput) -> float | None:
    """(E2E - TTFT) / (output_len - 1), or None when undefined."""
    if not output.success or not output.streamed or output.output_len < 2:
        return None
    return (output.latency - output.ttft) / (output.output_len - 1)


def compute_metrics(outputs: Sequence[RequestOutput], duration_s: float) -> BenchmarkMetrics:
    done = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_len for o in done)
    tpots = [t for t in (time_per_output_token(o) for o in done) if t is not None]
    cached = [o for o in done if o.cached_tokens is not None]
    cached_prompt = sum(o.prompt_len for o in cached)
    hit_rate = (sum(o.cached_tokens or 0 for o in cached) / cached_prompt
                if cached and cached_prompt > 0 else None)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    errors: list[str] = []
    for o in outputs:
        if not o.success and o.error not in errors and len(errors) < 5:
            errors.append(o.error)
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(outputs) - len(done),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        expected_output_tokens=sum(o.expected_output_len for o in done),
        output_len_mismatches=sum(o.output_len != o.expected_output_len for o in done),
        request_throughput=per_s(len(done)),
        input_throughput=per_s(total_in),
        output_throughput=per_s(total_out),
        total_throughput=per_s(total_in + total_out),
        cache_hit_rate=hit_rate,
        ttft=LatencyStats.from_seconds([o.ttft for o in done if o.streamed]),
        tpot=LatencyStats.from_seconds(tpots),
        itl=LatencyStats.from_seconds([gap for o in done for gap in o.itl]),
        e2e_latency=LatencyStats.from_seconds([o.latency for o in done]),
        errors=errors,
    )


def format_report(title: str, header: dict[str, Any], metrics: BenchmarkMetrics) -> str:
    """A fixed-width table: run settings, counts, throughputs, then latency rows."""
    width = 60
    lines = [f" {title} ".center(width, "=")]

    def row(name: str, value: Any) -> None:
        if isinstance(value, float):
            value = "n/a" if not math.isfinite(value) else f"{value:.2f}"
        elif value is None:
            value = "n/a"
        lines.append(f"{name:<40}{value!s:>20}")

    for name, value in header.items():
        row(name, value)
    row("Successful requests", metrics.completed)
    row("Failed requests", metrics.failed)
    row("Benchmark duration (s)", metrics.duration_s)
    row("Total input tokens", metrics.total_input_tokens)
    row("Total output tokens", metrics.total_output_tokens)
    row("Output length mismatches", metrics.output_len_mismatches)
    row("Request throughput (req/s)", metrics.request_throughput)
    row("Input token throughput (tok/s)", metrics.input_throughput)
    row("Output token throughput (tok/s)", metrics.output_throughput)
    row("Total token throughput (tok/s)", metrics.total_throughput)
    if metrics.cache_hit_rate is not None:
        row("Prefix cache hit rate (reported)", metrics.cache_hit_rate)
    for label, stats in (("TTFT", metrics.ttft), ("TPOT", metrics.tpot), ("ITL", metrics.itl),
                         ("E2E latency", metrics.e2e_latency)):
        lines.append(f" {label} (ms) ".center(width, "-"))
        row("Mean", stats.mean_ms)
        row("Median", stats.median_ms)
        row("P90", stats.p90_ms)
        row("P99", stats.p99_ms)
    for err in metrics.errors:
        lines.append(f"error: {err[:200]}")
    lines.append("=" * width)
    return "\n".join(lines)
