"""FP8 against bf16 on the bundled SmolLM2-135M (CPU, torch-native attention): per-token
log-likelihood of tests/data/english_paragraphs.txt, greedy agreement over 4 prompts x 48 tokens,
and the chat answer to "What is the capital of France?", for each FP8 mode.

  python benchmarks/fp8_numerics.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import radixserve  # noqa: E402
from tests.models.fp8_numerics import compare, measure  # noqa: E402

MODES = {"bf16": {}, "fp8 KV (e4m3)": {"kv_cache_dtype": "fp8_e4m3"},
         "fp8 KV (e5m2)": {"kv_cache_dtype": "fp8_e5m2"},
         "fp8 weights": {"quantization": "fp8"},
         "fp8 weights + fp8 KV (e4m3)": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}}


def main() -> int:
    results = {}
    for label, kwargs in MODES.items():
        engine = radixserve.Engine("SmolLM2-135M-Instruct", dtype="bfloat16",
                                   attention_backend="torch_native", chunked_prefill_size=64,
                                   **kwargs)
        try:
            results[label] = measure(engine)
        finally:
            engine.shutdown()
    print("| mode | mean abs dlogprob | max abs | mean shift | greedy agreement | chat answer |")
    print("|---|---|---|---|---|---|")
    for label, numerics in results.items():
        if label == "bf16":
            print(f"| bf16 | - | - | - | - | {numerics.answer.strip()!r} |")
            continue
        f = compare(results["bf16"], numerics)
        print(f"| {label} | {f['mean_abs_logprob_diff']:.3f} | {f['max_abs_logprob_diff']:.3f} "
              f"| {f['mean_logprob_shift']:+.4f} | {f['greedy_agreement']:.0%} "
              f"| {numerics.answer.strip()!r} |")
    print(json.dumps({k: compare(results["bf16"], v) for k, v in results.items()
                      if k != "bf16"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
