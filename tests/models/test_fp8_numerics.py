"""FP8 against bf16 on the bundled SmolLM2-135M (real weights, CPU, torch-native attention):
the per-token log-likelihood of natural English (tests/data/english_paragraphs.txt) moves by
less than the stated bounds, greedy continuations mostly agree, and the chat answer to "What is
the capital of France?" is still Paris. Figures for every mode: benchmarks/fp8_numerics.py."""
from __future__ import annotations

import pytest
import torch

import radixserve
from radixserve.config import cpu_computes_natively
from tests.models.fp8_numerics import Numerics, compare, measure

# bounds stated in docs/PERFORMANCE.md, with the measured values beside them
# (measured 2026-12-01: e4m3 KV 0.086 / +0.007 / 60%; FP8 weights 0.153 / +0.018 / 44%)
BOUNDS = {"kv_cache_dtype=fp8_e4m3": dict(mean_abs=0.15, shift=0.05, agreement=0.35),
          "quantization=fp8": dict(mean_abs=0.25, shift=0.06, agreement=0.25)}


# bf16 where the CPU computes it natively (the bounds were stated there); float32 elsewhere,
# where oneDNN emulates bf16 ~7x slower than float32 (the FP8 error is what is measured)
DTYPE = "bfloat16" if cpu_computes_natively(torch.bfloat16) else "float32"


def _numerics(**kwargs) -> Numerics:
    engine = radixserve.Engine("SmolLM2-135M-Instruct", dtype=DTYPE,
                               attention_backend="torch_native", chunked_prefill_size=64,
                               **kwargs)
    try:
        return measure(engine, new_tokens=24)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def baseline() -> Numerics:
    return _numerics()


# FP8 weights are also covered by tests/loader/test_fp8_checkpoints.py (each format against
# its dequantised twin); their numerics run here with --run-slow
@pytest.mark.parametrize("mode", [pytest.param(mode, marks=pytest.mark.slow)
                                  if mode.startswith("quantization") else mode
                                  for mode in sorted(BOUNDS)])
def test_fp8_stays_within_its_bounds(mode: str, baseline: Numerics) -> None:
    key, value = mode.split("=")
    got = _numerics(**{key: value})
    figures = compare(baseline, got)
    bound = BOUNDS[mode]
    assert figures["mean_abs_logprob_diff"] < bound["mean_abs"], figures
    assert abs(figures["mean_logprob_shift"]) < bound["shift"], figures
    assert figures["greedy_agreement"] >= bound["agreement"], figures
    assert "Paris" in baseline.answer
    if mode == "kv_cache_dtype=fp8_e4m3" and "Paris" not in got.answer:
        # Known defect (issue 13, 2026-12-01): the first answer token is a near-tie ("The"
        # -1.88 vs "L" -1.96 in fp32), and e4m3 KV moves it by 0.1-0.6 nats. On an AVX512-BF16
        # CPU in bf16 it kept "The"; on an AVX2 CPU (fp32, or emulated bf16) it picks "L".
        pytest.xfail(f"e4m3 KV answer left Paris on this CPU: {got.answer!r}")
    assert "Paris" in got.answer
