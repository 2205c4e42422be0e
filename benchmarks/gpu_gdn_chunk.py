"""Where a Gated DeltaNet extend's time goes, piece by piece (one layer, one rank).

    python3 benchmarks/gpu_gdn_chunk.py [--tokens 8192] [--heads 32] [--key-dim 128]
        [--value-dim 128] [--seqs 1]

Times on random prepared inputs (CUDA events, median of 10 after a warm-up) the torch form's
pieces: the closed form of every chunk (`gated_delta_rule.chunk_terms`), its triangular solve
alone, the chunk-to-chunk loop; then the two Triton launches (`kernels/gdn_chunk.chunked_triton`)
with their largest deviation from the torch form, each launch alone, and the scan at several
value-column blocks and pipelining depths.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.layers.gated_delta_rule import (CHUNK, chunk_terms, chunked,  # noqa: E402
                                                prepare_qk, scan_chunks)
from radixserve.layers.kernels.gdn_chunk import (chunk_prep, chunk_scan,  # noqa: E402
                                                 chunked_triton)
from benchmarks.gpu_moe import bench  # noqa: E402


def _time(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median milliseconds of fn after one warm-up call."""
    return bench(fn, repeats) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192, help="per sequence")
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="value heads on this rank")
    parser.add_argument("--key-heads", type=int, default=16)
    parser.add_argument("--key-dim", type=int, default=128)
    parser.add_argument("--value-dim", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.seqs, -(-args.tokens // CHUNK) * CHUNK)
    q, k = prepare_qk(
        torch.randn(*shape, args.key_heads, args.key_dim, device="cuda", generator=gen),
        torch.randn(*shape, args.key_heads, args.key_dim, device="cuda", generator=gen),
        args.heads // args.key_heads)
    v = torch.randn(*shape, args.heads, args.value_dim, device="cuda", generator=gen)
    g = -torch.rand(*shape, args.heads, device="cuda", generator=gen) * 0.1
    beta = torch.rand(*shape, args.heads, device="cuda", generator=gen)
    state = torch.zeros(args.seqs, args.heads, args.key_dim, args.value_dim, device="cuda")
    print(f"{args.seqs} x {shape[1]} tokens, {args.heads} value heads, key {args.key_dim}, "
          f"value {args.value_dim}")
    terms = chunk_terms(q, k, v, g, beta)
    closed_form = _time(lambda: chunk_terms(q, k, v, g, beta))
    print(f"chunk_terms (every chunk's closed form): {closed_form:.3f} ms")
    # the solve's inputs, as chunk_terms builds them
    by = k.float().transpose(1, 2).reshape(args.seqs, args.heads, -1, CHUNK, args.key_dim)
    system = by @ by.transpose(-1, -2) * 0.5
    rhs = torch.randn(*system.shape[:-1], args.key_dim + args.value_dim, device="cuda")
    trsm = _time(lambda: torch.linalg.solve_triangular(system, rhs, upper=False,
                                                       unitriangular=True))
    print(f"  its triangular solve: {trsm:.3f} ms")
    print(f"scan, torch loop: {_time(lambda: scan_chunks(terms, state), 3):.3f} ms")
    ref_out, ref_state = chunked(q, k, v, g, beta, state)
    took = _time(lambda: chunked_triton(q, k, v, g, beta, state))
    out, final = chunked_triton(q, k, v, g, beta, state)
    err = max((out - ref_out).abs().max().item(), (final - ref_state).abs().max().item())
    print(f"chunked_triton (two launches): {took:.3f} ms (max |diff| {err:.2e} of max |out| "
          f"{ref_out.abs().max().item():.2e})")
    qc, kc, vc = (x.contiguous() for x in (q, k, v))
    prep = chunk_prep(kc, vc, g.contiguous(), beta.contiguous())
    print(f"  launch 1 (prep): {_time(lambda: chunk_prep(kc, vc, g, beta)):.3f} ms")
    for block_v in (16, 32, 64):
        for stages in (1, 2):
            try:
                took = _time(lambda: chunk_scan(qc, kc, prep, state, block_v, stages))
                print(f"  launch 2 (scan), {block_v} value columns, {stages} stages: "
                      f"{took:.3f} ms")
            except Exception as exc:  # out of shared memory at some settings
                print(f"  launch 2 (scan), {block_v} value columns, {stages} stages: "
                      f"{type(exc).__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
