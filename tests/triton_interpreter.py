"""Workarounds for the Triton interpreter (CPU) in tests of kernels that quantise in registers.

Triton 3.x's interpreter rounds a float to e4m3 by adding the cut-off bit to the 3-bit mantissa
without carrying into the exponent, so a value that rounds up across a power of two loses it
(31.98 becomes 16, not 32). Compiled kernels use the hardware's conversion and are unaffected.
`fix_fp8_rounding()` sends float32/float16 -> e4m3 conversions through torch's (round to
nearest even) instead; it changes nothing outside the interpreter.
"""
from __future__ import annotations

import os

import numpy as np
import torch


def fix_fp8_rounding() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter
    if getattr(interpreter._convert_float, "fp8_rounding_fixed", False):
        return
    original = interpreter._convert_float
    sources = {tl.float32: np.float32, tl.float16: np.float16}

    def convert(data, input_dtype, output_dtype, rounding_mode):  # type: ignore[no-untyped-def]
        if output_dtype == tl.float8e4nv and input_dtype in sources:
            values = torch.from_numpy(np.ascontiguousarray(data).view(sources[input_dtype]))
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)
        return original(data, input_dtype, output_dtype, rounding_mode)

    convert.fp8_rounding_fixed = True  # type: ignore[attr-defined]
    interpreter._convert_float = convert
