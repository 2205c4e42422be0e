"""Decode attention launched eagerly a few times at the FP8 offline run's batch, for a profiler
to look inside one launch (Nsight Compute), FP8 pool first, then bf16:

    ncu --clock-control none --set full -k regex:_decode_split_kernel --launch-skip 1 \\
        --launch-count 1 python3 benchmarks/gpu_decode_attn_once.py --kv-dtype fp8
    (likewise --kv-dtype bf16)

Llama-3.1-8B heads (32 query, 8 KV, head_dim 128), random slots, context 1536, one layer, the
config the backend runs for that pool (FP8: V loaded with K). Figures come from the profiler;
this script prints only the config.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_kernels import HEAD_DIM, NUM_HEADS, make_pool  # noqa: E402
from radixserve.attention.kernels.decode_attention import (  # noqa: E402
    decode_attention_fwd, default_decode_config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-dtype", choices=["fp8", "bf16"], default="fp8")
    parser.add_argument("--batch", type=int, default=862)
    parser.add_argument("--context", type=int, default=1536)
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    config = default_decode_config(kv_dtype)
    pool = make_pool([args.context] * args.batch, 1, kv_dtype)
    q = torch.randn((args.batch, NUM_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    mid_out = torch.empty((args.batch, NUM_HEADS, 1, HEAD_DIM), device="cuda")
    mid_lse = torch.empty((args.batch, NUM_HEADS, 1), device="cuda")
    for _ in range(args.launches):
        decode_attention_fwd(q, pool.k_buffers[0], pool.v_buffers[0], out, pool.req_to_token,
                             pool.req_pool_indices, pool.seq_lens, mid_out, mid_lse,
                             HEAD_DIM ** -0.5, config)
    torch.cuda.synchronize()
    print(f"{args.kv_dtype} pool, batch {args.batch}, context {args.context}: {config}")


if __name__ == "__main__":
    main()
