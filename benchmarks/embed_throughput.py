"""Embedding throughput (--is-embedding): N inputs of L tokens encoded in one call, after a
warm-up; input tokens per second and the matmul rate that implies (2 x the decoder's matmul
parameters x tokens; attention's own FLOPs left out, so a lower bound).

    python3 benchmarks/embed_throughput.py --model-path benchmarks/configs/llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --num-inputs 512 --input-len 512
"""
from __future__ import annotations

import argparse
import json
import random
import time

import radixserve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = radixserve.Engine(args.model_path, load_format=args.load_format, dtype=args.dtype,
                               is_embedding=True, skip_tokenizer_init=True,
                               disable_radix_cache=True)
    rng = random.Random(0)
    inputs = [[rng.randrange(100, 30000) for _ in range(args.input_len)]
              for _ in range(args.num_inputs)]
    engine.encode(input_ids=inputs[:4])  # warm-up
    start = time.perf_counter()
    outs = engine.encode(input_ids=inputs)
    wall = time.perf_counter() - start
    decoder = engine.scheduler.runner.model.model  # tp 1: the scheduler runs in-process
    params = sum(p.numel() for n, p in decoder.named_parameters()
                 if p.dim() == 2 and "embed" not in n)
    engine.shutdown()
    tokens = args.num_inputs * args.input_len
    row = {"inputs": args.num_inputs, "input_len": args.input_len, "wall_s": round(wall, 3),
           "tok_per_s": round(tokens / wall), "dim": len(outs[0]["embedding"]),
           "matmul_tflops": round(2 * params * tokens / wall / 1e12, 1)}
    print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
