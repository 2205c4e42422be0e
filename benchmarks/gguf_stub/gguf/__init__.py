"""A stand-in for the `gguf` package on machines without it (the lent GPU has no network).

radixserve's loader imports gguf at module level even on the dummy and safetensors paths;
benchmarks/gpu_suite.sh puts this folder on PYTHONPATH only when `import gguf` fails, so those
paths import. Anything that really reads a GGUF file fails loudly.
"""
from __future__ import annotations

STUB = True
