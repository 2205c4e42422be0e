"""The MoE and MLA kernels on the H200 at real shapes: correctness, speed, and a block-size sweep.

  python benchmarks/gpu_moe.py --out DIR [--sweep] [--time-budget 240]

1. fused MoE (layers/kernels/fused_moe.py) against the per-expert torch loop
   (FusedMoE.forward_native) in bf16 on Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V2-Lite expert
   shapes at 1 .. 4096 tokens: max error, time, TB/s of expert weights read (distinct experts
   hit) and TFLOP/s.
2. --sweep: for each shape and token bucket, the best of a candidate list of block configs; the
   tables go to DIR/moe_configs/E{experts}_N{n}_K{k}.json (copy them to
   radixserve/layers/kernels/moe_configs/ to use them: the H200's into the folder itself,
   another board's into its boards/NAME/, kernels/board_tables.py).
3. MLA decode kernel (attention/kernels/mla_decode.py) against the reference on V2-Lite shapes
   (16 heads, latent 512 + rope 64) at batch 1 / 64 / 256 and context 1024 / 4096, with the
   KV TB/s it reaches.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.layers.kernels import fused_moe as fm  # noqa: E402
from radixserve.layers.moe.experts import FusedMoE  # noqa: E402
from radixserve.layers.moe.router import RoutingConfig, select_experts  # noqa: E402

# name -> (experts, top_k, hidden, expert intermediate)
SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768),
          "deepseek-v2-lite": (64, 6, 2048, 1408)}
TOKENS = (1, 8, 32, 128, 512, 2048, 4096)
CANDIDATES = [
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=3),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
]


def bench(fn, repeats: int = 20) -> float:
    """Median seconds of fn() by CUDA events, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def make(shape: tuple[int, int, int, int], num_tokens: int, seed: int = 0):
    num_experts, top_k, hidden, inter = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    moe = FusedMoE(num_experts, hidden, inter).cuda().to(torch.bfloat16)
    moe.w13_weight.data.normal_(0, 0.02, generator=gen)
    moe.w2_weight.data.normal_(0, 0.02, generator=gen)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    topk = select_experts(logits, RoutingConfig(num_experts, top_k, renormalize=True))
    return moe, x, topk


def moe_figures(name: str, shape, tokens: tuple[int, ...], lines: list[str]) -> None:
    num_experts, top_k, hidden, inter = shape
    for num_tokens in tokens:
        moe, x, topk = make(shape, num_tokens)
        got = fm.fused_experts(x, moe.w13_weight, moe.w2_weight, topk.weights, topk.ids)
        ref = moe.forward_native(x, topk)
        err = (got.float() - ref.float()).abs().max().item()
        scale = ref.float().abs().max().item()
        seconds = bench(lambda: fm.fused_experts(x, moe.w13_weight, moe.w2_weight,
                                                 topk.weights, topk.ids))
        distinct = int(torch.unique(topk.ids).numel())
        weight_bytes = distinct * 3 * hidden * inter * 2
        flops = 2.0 * num_tokens * top_k * 3 * hidden * inter
        line = (f"moe {name:<17} tokens {num_tokens:>5}: {seconds * 1e6:8.1f} us  "
                f"{weight_bytes / seconds / 1e12:5.2f} TB/s ({distinct} experts)  "
                f"{flops / seconds / 1e12:6.1f} TFLOP/s  max err {err:.3g} (of {scale:.3g})")
        print(line, flush=True)
        lines.append(line)


def sweep(name: str, shape, out: Path, deadline: float, lines: list[str]) -> None:
    num_experts, top_k, hidden, inter = shape
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        table: dict[int, dict[str, int]] = {}
        for num_tokens in TOKENS:
            if time.time() > deadline:
                break
            gen = torch.Generator(device="cuda").manual_seed(1)
            a = torch.randn(num_tokens, k, device="cuda", generator=gen).to(torch.bfloat16)
            w = (torch.randn(num_experts, n, k, device="cuda", generator=gen) * 0.02).to(
                torch.bfloat16)
            logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
            topk = select_experts(logits, RoutingConfig(num_experts, top_k, renormalize=True))
            out_t = torch.empty(num_tokens * top_k, n, device="cuda", dtype=torch.bfloat16)
            weights = topk.weights.reshape(-1)
            best = None
            for cfg in CANDIDATES:
                aligned = fm.moe_align_block_size(topk.ids, cfg["BLOCK_M"], num_experts)
                try:
                    seconds = bench(lambda: fm.invoke_moe_gemm(a, w, out_t, weights, aligned,
                                                               top_k, False, cfg), repeats=10)
                except Exception as exc:  # out of shared memory, ...
                    print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
                    continue
                if best is None or seconds < best[0]:
                    best = (seconds, cfg)
            if best is not None:
                table[num_tokens] = best[1]
                line = (f"sweep {name:<17} N={n:<6} K={k:<6} tokens {num_tokens:>5}: "
                        f"{best[0] * 1e6:8.1f} us  {best[1]}")
                print(line, flush=True)
                lines.append(line)
        if table:
            folder = out / "moe_configs"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"E{num_experts}_N{n}_K{k}.json").write_text(json.dumps(table, indent=1))


def mla_figures(lines: list[str]) -> None:
    from radixserve.attention.kernels.mla_decode import (mla_decode_attention_fwd,
                                                         mla_decode_reference)
    heads, latent, rope = 16, 512, 64
    for bs, ctx in ((1, 1024), (1, 4096), (64, 1024), (64, 4096), (256, 1024)):
        gen = torch.Generator(device="cuda").manual_seed(bs)
        slots = bs * ctx + 1
        kv = torch.randn(slots, 1, latent + rope, device="cuda", generator=gen).to(torch.bfloat16)
        req_to_token = (torch.arange(bs * ctx, device="cuda", dtype=torch.int32) + 1).view(bs, ctx)
        rows = torch.arange(bs, device="cuda")
        seq_lens = torch.full((bs,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(bs, heads, latent + rope, device="cuda", generator=gen).to(torch.bfloat16)
        splits = max(1, min(16, 2 * 132 // bs))
        out = torch.empty(bs, heads, latent, device="cuda", dtype=torch.bfloat16)
        mid = torch.empty(bs, heads, splits, latent, device="cuda")
        lse = torch.empty(bs, heads, splits, device="cuda")
        scale = 192 ** -0.5

        def run() -> None:
            mla_decode_attention_fwd(q, kv, out, req_to_token, rows, seq_lens, mid, lse, scale,
                                     latent)
        seconds = bench(run)
        err = float("nan")
        if bs <= 64:
            ref = mla_decode_reference(q, kv, req_to_token, rows, seq_lens, scale, latent)
            err = (out.float() - ref).abs().max().item()
        kv_bytes = bs * ctx * (latent + rope) * 2
        line = (f"mla decode bs {bs:>3} ctx {ctx:>5}: {seconds * 1e6:8.1f} us  "
                f"{kv_bytes / seconds / 1e12:5.2f} TB/s of latent KV  max err {err:.3g}")
        print(line, flush=True)
        lines.append(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/gpu_moe")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--time-budget", type=float, default=240.0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_moe: no CUDA device; nothing to run")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.time_budget
    lines: list[str] = []
    mla_figures(lines)
    if args.sweep:
        for name, shape in SHAPES.items():
            sweep(name, shape, out, deadline, lines)
        fm._tuned_table.cache_clear()
        fm.CONFIG_DIR = out / "moe_configs"  # measure with the tables just written
    for name, shape in SHAPES.items():
        moe_figures(name, shape, TOKENS if time.time() < deadline else (1, 128), lines)
    (out / "gpu_moe.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
