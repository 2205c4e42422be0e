"""Time the per-row LoRA kernels (layers/kernels/lora_rows.py) on a GPU at Llama-3.1-8B's
adapted products (rank 16 on every projection, as a merged layer holds them: q|k|v three
pieces, gate|up two), against torch's two forms (one adapter's A and B; each adapter's rows
gathered), at decode batch sizes, with the rows spread over 4 adapters (and one).

  python benchmarks/gpu_lora_rows.py [--rank 16] [--rows 1 8 32 64]

Each form is checked against the definition first. Times are CUDA-graph replays (triton's
do_bench_cudagraph) of ten calls (different adapter stacks each, so they come from HBM), per
call; bytes are the A and B of the slots the rows use. Figures only.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from radixserve.layers.kernels.lora_rows import add_lora_rows  # noqa: E402

# (name, out, in, pieces) of Llama-3.1-8B's adapted products at tp 1
SHAPES = [("qkv", 6144, 4096, 3), ("o", 4096, 4096, 1), ("gate_up", 28672, 4096, 2),
          ("down", 4096, 14336, 1)]
COPIES = 10
SLOTS = 4


def _graph_us(fn) -> float:
    """Microseconds per call of fn (COPIES calls), from CUDA-graph replays."""
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=20) * 1000 / COPIES


def _torch_single(x, a, b, width, slot, out):
    cols = slice(slot * width, (slot + 1) * width)
    out.addmm_(x @ a[cols].t(), b[:, cols].t())


def _torch_grouped(x, a, b, width, groups, out):
    for slot, rows in groups:
        cols = slice(slot * width, (slot + 1) * width)
        out.index_add_(0, rows, (x.index_select(0, rows) @ a[cols].t()) @ b[:, cols].t())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: nothing to time")
        return 0
    dev, dtype = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, rank {args.rank}, {SLOTS} adapters' stacks")
    print(f"{'product':8s} {'rows':>4s} {'adapters':>8s} {'kernel us':>9s} {'GB/s':>6s} "
          f"{'torch one':>9s} {'torch grouped':>13s} {'max rel err':>11s}")
    for name, out_f, in_f, pieces in SHAPES:
        width = pieces * args.rank
        gen = torch.Generator(device=dev).manual_seed(out_f + in_f)
        stacks = [((torch.randn(SLOTS * width, in_f, generator=gen, device=dev) * 0.02
                    ).to(dtype),
                   (torch.randn(out_f, SLOTS * width, generator=gen, device=dev) * 0.02
                    ).to(dtype)) for _ in range(COPIES)]
        for m in args.rows:
            x = torch.randn(m, in_f, generator=gen, device=dev).to(dtype)
            out = torch.zeros(m, out_f, device=dev, dtype=dtype)
            for used in (1, SLOTS):
                slots = torch.arange(m, device=dev) % used
                a0, b0 = stacks[0]
                want = torch.zeros(m, out_f, device=dev)
                for t, s in enumerate(slots.tolist()):
                    cols = slice(s * width, (s + 1) * width)
                    want[t] = (x[t].float() @ a0[cols].float().t()) @ b0[:, cols].float().t()
                got = torch.zeros(m, out_f, device=dev, dtype=dtype)
                add_lora_rows(x, a0, b0, slots, width, got)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                kernel = _graph_us(lambda: [add_lora_rows(x, a, b, slots, width, out)
                                            for a, b in stacks])
                groups = [(s, (slots == s).nonzero().flatten()) for s in range(min(used, m))]
                grouped = _graph_us(lambda: [_torch_grouped(x, a, b, width, groups, out)
                                             for a, b in stacks])
                single = _graph_us(lambda: [_torch_single(x, a, b, width, 0, out)
                                            for a, b in stacks]) if used == 1 else float("nan")
                nbytes = min(used, m) * width * (in_f + out_f) * 2
                print(f"{name:8s} {m:4d} {min(used, m):8d} {kernel:9.1f} "
                      f"{nbytes / kernel / 1e3:6.0f} {single:9.1f} {grouped:13.1f} {err:11.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
