"""torch._scaled_mm with row-wise scales at Llama-3.1-8B's decoder shapes, with and without
`use_fast_accum` (the FP8 tensor cores' accumulator kept as it is instead of promoted to
float32 along K): the rate, and the error against float32 products of the same codes.

    python3 benchmarks/gpu_scaled_mm.py [--rows 256 512 900 8192]

The offline FP8 W + KV run's batches run these products at ~900 rows (decode) and 8192
(prefill chunks); `RADIXSERVE_FP8_FAST_ACCUM=1` turns the fast accumulation on in the
engine (kernels/fp8_gemm.py `scaled_mm_codes`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # (N, K)


def main() -> int:
    from gpu_kernels import time_graph
    from radixserve.layers.kernels.per_token_quant import per_token_quant
    from radixserve.layers.quantization.fp8 import FP8_DTYPE, quantize_per_channel
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512, 900, 8192])
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'product':>8} {'rows':>5} | {'TFLOP/s':>8} {'fast':>8} {'gain':>6} | "
          f"{'rel err':>8} {'fast':>8} | {'vs bf16':>8} {'fast':>8}")
    for name, (n, k) in SHAPES.items():
        w_bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        w_codes, w_scale = quantize_per_channel(w_bf16)
        w_ref = w_codes.float() * w_scale.float()
        scale_b = w_scale.reshape(1, -1).contiguous()
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            codes, x_scale = per_token_quant(x, FP8_DTYPE)
            ref = (codes.float() * x_scale) @ w_ref.t()
            unquantised = x.float() @ w_bf16.float().t()
            rates, errors, quant_errors = [], [], []
            for fast in (False, True):
                def product(fast: bool = fast) -> torch.Tensor:
                    return torch._scaled_mm(codes, w_codes.t(), scale_a=x_scale,
                                            scale_b=scale_b, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)
                rates.append(2 * m * n * k / time_graph(product) / 1e12)
                out = product().float()
                errors.append(((out - ref).abs().max() / ref.abs().max()).item())
                quant_errors.append(((out - unquantised).abs().max()
                                     / unquantised.abs().max()).item())
            print(f"{name:>8} {m:>5} | {rates[0]:>8.1f} {rates[1]:>8.1f} "
                  f"{rates[1] / rates[0]:>6.3f} | {errors[0]:>8.2e} {errors[1]:>8.2e} | "
                  f"{quant_errors[0]:>8.2e} {quant_errors[1]:>8.2e}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
