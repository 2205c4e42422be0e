"""What bf16 matmul rate cuBLAS reaches on this GPU, for the roofline's peak (bench/hardware.py
uses 796 TFLOP/s for the H200; session 5's 8192^3 run of gpu_peaks.py read 686).

Square products of several sizes and the prefill products of Llama-3.1-8B (8,192 tokens against
qkv, o, gate_up, down), each with normal-distributed and with small uniform operands (the
tensor cores' power draw, hence their clock, depends on the data), timed from CUDA graphs,
best of three:

    python3 benchmarks/gpu_matmul_peak.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # name: (M, N, K) of x[M, K] @ w[N, K].T
    "square 4096": (4096, 4096, 4096),
    "square 8192": (8192, 8192, 8192),
    "square 16384": (16384, 16384, 16384),
    "prefill 8192 x qkv": (8192, 6144, 4096),
    "prefill 8192 x o": (8192, 4096, 4096),
    "prefill 8192 x gate_up": (8192, 28672, 4096),
    "prefill 8192 x down": (8192, 4096, 14336),
}


def main() -> None:
    from gpu_kernels import time_graph
    print(torch.cuda.get_device_name(), flush=True)
    for name, (m, n, k) in SHAPES.items():
        figures = []
        for data in ("randn", "uniform 1e-3"):
            if data == "randn":
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            else:
                x = torch.rand(m, k, device="cuda", dtype=torch.bfloat16) * 1e-3
                w = torch.rand(n, k, device="cuda", dtype=torch.bfloat16) * 1e-3
            best = min(time_graph(lambda: x @ w.t()) for _ in range(3))
            figures.append(f"{data}: {2 * m * n * k / best / 1e12:6.1f}")
            del x, w
        print(f"{name:24s} TFLOP/s  " + "   ".join(figures), flush=True)


if __name__ == "__main__":
    main()
