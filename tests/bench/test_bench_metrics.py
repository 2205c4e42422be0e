"""Metric computation against numbers worked out by hand (linear-interpolated percentiles)."""
from __future__ import annotations

import json

import pytest

from radixserve.bench.metrics import (LatencyStats, RequestOutput, compute_metrics,
                                      format_report, time_per_output_token)


def _outputs() -> list[RequestOutput]:
    a = RequestOutput(success=True, prompt_len=10, output_len=5, expected_output_len=5,
                      cached_tokens=5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1])
    b = RequestOutput(success=True, prompt_len=20, output_len=3, expected_output_len=4,
                      cached_tokens=0, ttft=0.2, latency=0.6, itl=[0.1, 0.3])
    c = RequestOutput(success=True, prompt_len=30, output_len=1, expected_output_len=1,
                      ttft=0.3, latency=0.3)
    d = RequestOutput(success=False, prompt_len=40, expected_output_len=8, error="HTTP 400: no")
    return [a, b, c, d]


def test_tpot_definition() -> None:
    a, b, c, d = _outputs()
    assert time_per_output_token(a) == pytest.approx(0.4 / 4)
    assert time_per_output_token(b) == pytest.approx(0.4 / 2)
    assert time_per_output_token(c) is None  # one token: no gap to average
    assert time_per_output_token(d) is None  # failed


def test_counts_and_throughputs() -> None:
    m = compute_metrics(_outputs(), duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 9)
    assert m.expected_output_tokens == 10 and m.output_len_mismatches == 1
    assert m.request_throughput == pytest.approx(1.5)
    assert m.input_throughput == pytest.approx(30.0)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_throughput == pytest.approx(34.5)
    assert m.cache_hit_rate == pytest.approx(5 / 30)  # c reported no cache figure
    assert m.errors == ["HTTP 400: no"]


def test_latency_percentiles_by_hand() -> None:
    m = compute_metrics(_outputs(), duration_s=2.0)
    # TTFT 100, 200, 300 ms: p90 sits at rank 1.8 -> 200 + 0.8 * 100
    assert (m.ttft.mean_ms, m.ttft.median_ms, m.ttft.p90_ms, m.ttft.p99_ms) == \
        pytest.approx((200, 200, 280, 298))
    # TPOT 100, 200 ms
    assert (m.tpot.mean_ms, m.tpot.median_ms, m.tpot.p90_ms, m.tpot.p99_ms) == \
        pytest.approx((150, 150, 190, 199))
    # ITL 100 x5, 300: rank 4.5 -> halfway between 100 and 300
    assert m.itl.count == 6
    assert (m.itl.mean_ms, m.itl.median_ms, m.itl.p90_ms, m.itl.p99_ms) == \
        pytest.approx((800 / 6, 100, 200, 290))
    # E2E 300, 500, 600
    assert (m.e2e_latency.mean_ms, m.e2e_latency.median_ms, m.e2e_latency.p90_ms,
            m.e2e_latency.p99_ms) == pytest.approx((1400 / 3, 500, 580, 598))


def test_unstreamed_requests_have_no_ttft_or_tpot() -> None:
    out = RequestOutput(success=True, prompt_len=4, output_len=6, expected_output_len=6,
                        ttft=0.9, latency=0.9, streamed=False)
    m = compute_metrics([out], duration_s=1.0)
    assert m.ttft.count == 0 and m.tpot.count == 0 and m.e2e_latency.count == 1
    flat = m.to_flat_dict()
    assert flat["mean_ttft_ms"] is None and flat["mean_e2e_latency_ms"] == pytest.approx(900)
    json.dumps(flat, allow_nan=False)  # strict JSON: no NaN leaks


def test_flat_dict_and_report() -> None:
    m = compute_metrics(_outputs(), duration_s=2.0)
    flat = m.to_flat_dict()
    assert flat["p99_ttft_ms"] == pytest.approx(298) and flat["completed"] == 3
    assert "ttft" not in flat
    report = format_report("t", {"Backend": "x"}, m)
    assert "Successful requests" in report and "HTTP 400" in report


def test_empty_stats_are_nan() -> None:
    stats = LatencyStats.from_seconds([])
    assert stats.count == 0 and stats.mean_ms != stats.mean_ms
