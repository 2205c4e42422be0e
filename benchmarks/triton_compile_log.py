"""Run a module (python -m style) with every Triton JIT compile logged: the kernel, when, how
long, and its specialisation (argument attributes such as 16-byte alignment / divisibility),
to find kernels that compile inside a timed run.

    python3 benchmarks/triton_compile_log.py radixserve.bench.offline <its flags>
"""
from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

import triton.runtime.jit as jit

_original = jit.JITFunction._do_compile
_start = time.perf_counter()


def _logged(self, key, signature, device, constexprs, options, attrs, warmup):
    t0 = time.perf_counter()
    kernel = _original(self, key, signature, device, constexprs, options, attrs, warmup)
    print(f"[triton compile] t={t0 - _start:7.2f}s {self.fn.__name__} "
          f"{(time.perf_counter() - t0) * 1e3:.0f} ms attrs={attrs} "
          f"signature={signature}", file=sys.stderr, flush=True)
    return kernel


jit.JITFunction._do_compile = _logged
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
runpy.run_module(module, run_name="__main__")
