"""Constrained decoding figures: the cost of a grammar per decode step, and jump-forward's
speed-up on a JSON-schema workload. Prints one table; runs one Engine (the server's scheduler).

CPU, the bundled SmolLM2-135M:
    python benchmarks/constrained_decoding.py
H200, Llama-3.1-8B shapes with dummy weights (a dummy model has no tokenizer: grammars use the
bundled SmolLM2 tokenizer's vocabulary inside the model's larger one, or --tokenizer-path):
    python benchmarks/constrained_decoding.py --model-path benchmarks/configs/llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --batch-sizes 1 8 32 64 --steps 64

1. Per-step cost: `bs` requests decode `steps` tokens, unconstrained and under a regex that
   never ends ([a-z ,.]+; min_new_tokens keeps EOS off, so every row decodes every step), and
   unconstrained with the overlap schedule off (constrained batches decode synchronously, so
   this separates the mask's own cost from the lost overlap). A step's time is
   (t(steps) - t(1)) / (steps - 1): prefill and start-up cancel out.
   Then the mask alone: host time to fill a batch's bitmask (JSON schema, start state) and
   time to apply it to the logits.
2. Jump-forward: `--jump-requests` requests of a JSON schema with long fixed keys and enums,
   greedy, with and without jump-forward (toggled on the same Engine): wall time, output
   tokens, forward passes (prefill + decode), speed-up in wall time and in time per output
   token (the outputs differ: jump-forward's tokens are the tokenizer's, which the model then
   continues from, so the two runs write different values and lengths).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's radixserve

PROMPT = "Write a short answer about the weather in Paris and London today."
NEVER_ENDS = r"[a-z ,.]+"
ORDER_SCHEMA = {"type": "object", "properties": {
    "customer_first_name": {"type": "string", "maxLength": 8},
    "preferred_delivery_window": {"enum": ["weekday_morning", "weekday_afternoon",
                                           "weekend_any_time"]},
    "gift_wrapping_requested": {"type": "boolean"},
    "number_of_items_in_order": {"type": "integer", "minimum": 1, "maximum": 9},
    "shipping_method": {"enum": ["standard_ground_shipping", "express_next_day_delivery"]},
    "signature_required_on_delivery": {"type": "boolean"},
    "loyalty_programme_membership_tier": {"enum": ["bronze", "silver", "gold"]}},
    "required": ["customer_first_name", "preferred_delivery_window", "gift_wrapping_requested",
                 "number_of_items_in_order", "shipping_method",
                 "signature_required_on_delivery", "loyalty_programme_membership_tier"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokenizer-path", default="SmolLM2-135M-Instruct",
                   help="tokenizer for models without one (dummy weights)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--jump-requests", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--context-length", type=int, default=2048)
    return p


def start_engine(args: argparse.Namespace) -> Any:
    from radixserve import Engine
    from radixserve.loader import get_tokenizer

    kwargs: dict[str, Any] = dict(load_format=args.load_format, dtype=args.dtype,
                                  context_length=args.context_length,
                                  max_total_tokens=args.max_total_tokens)
    if args.model_path:
        kwargs["model_path"] = args.model_path
    engine = Engine(**kwargs)
    if engine.tokenizer is None:  # dummy weights: borrow a tokenizer for the grammars
        tokenizer = get_tokenizer(args.tokenizer_path)
        engine.tokenizer = tokenizer
        engine.scheduler.grammars.tokenizer = tokenizer
    return engine


def timed(engine: Any, prompts: list[str], params: dict[str, Any]) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, outs


def step_ms(engine: Any, bs: int, steps: int, grammar: dict[str, str],
            repeats: int = 3) -> float:
    prompts = [f"{i}. {PROMPT}" for i in range(bs)]

    def run(n: int) -> float:
        params = {"max_new_tokens": n, "min_new_tokens": n, "temperature": 0, **grammar}
        return timed(engine, prompts, params)[0]

    run(2)  # warm-up: grammar compiled, caches primed
    # the best of `repeats`: the CPU figures share their machine
    best_long = min(run(steps) for _ in range(repeats))
    best_short = min(run(1) for _ in range(repeats))
    return (best_long - best_short) / (steps - 1) * 1e3


def per_step_rows(engine: Any, args: argparse.Namespace) -> list[str]:
    rows = ["| batch | unconstrained ms/step | same, no overlap | regex ms/step | overhead |",
            "|---:|---:|---:|---:|---:|"]
    launcher = engine.scheduler.launcher
    for bs in args.batch_sizes:
        free = step_ms(engine, bs, args.steps, {})
        engine.scheduler.launcher = None  # the overlap schedule off, on the same engine
        sync = step_ms(engine, bs, args.steps, {})
        engine.scheduler.launcher = launcher
        constrained = step_ms(engine, bs, args.steps, {"regex": NEVER_ENDS})
        rows.append(f"| {bs} | {free:.2f} | {sync:.2f} | {constrained:.2f} | "
                    f"{(constrained / free - 1) * 100:+.0f}% |")
    return rows


def mask_rows(engine: Any, args: argparse.Namespace, iters: int = 100) -> list[str]:
    """Host time to fill a batch's bitmask from its matchers, and device time to apply it."""
    import torch

    from radixserve.core.req import Req
    from radixserve.core.sampling_params import SamplingParams
    from radixserve.executor.vocab_mask import apply_vocab_mask
    from radixserve.scheduler.grammar.vocab_mask import batch_vocab_mask

    grammars, vocab = engine.scheduler.grammars, engine.scheduler.runner.vocab_size
    device = engine.scheduler.runner.device
    compiled = grammars.backend.request(("json_schema", json.dumps(ORDER_SCHEMA))).result()
    rows = ["| batch | fill bitmask (host) ms | apply to logits ms |", "|---:|---:|---:|"]
    for bs in args.batch_sizes:
        reqs = [Req(str(i), [1], SamplingParams()) for i in range(bs)]
        for req in reqs:
            req.grammar = grammars.backend.new_matcher(compiled)
        logits = torch.randn(bs, vocab, device=device)
        start = time.perf_counter()
        for _ in range(iters):
            mask = batch_vocab_mask(reqs, vocab, device)
        fill = (time.perf_counter() - start) / iters
        start = time.perf_counter()
        for _ in range(iters):
            apply_vocab_mask(logits, mask)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        apply = (time.perf_counter() - start) / iters
        rows.append(f"| {bs} | {fill * 1e3:.3f} | {apply * 1e3:.3f} |")
    return rows


def count_passes(runner: Any) -> list[int]:
    """Count the runner's forward passes (prefill, extend and decode) from now on."""
    counter = [0]
    for name in ("forward", "forward_decode_async"):
        method = getattr(runner, name)

        def counted(*a: Any, _method: Any = method, **k: Any) -> Any:
            counter[0] += 1
            return _method(*a, **k)
        setattr(runner, name, counted)
    return counter


def jump_forward_rows(engine: Any, args: argparse.Namespace) -> list[str]:
    rows = ["| requests | plain: s, tokens, passes | jump-forward: s, tokens, passes, tokens "
            "jumped | speed-up (wall) | speed-up (ms per output token) | same output |",
            "|---:|---:|---:|---:|---:|---:|"]
    passes = count_passes(engine.scheduler.runner)
    params = {"max_new_tokens": 256, "temperature": 0, "json_schema": json.dumps(ORDER_SCHEMA)}
    grammars = engine.scheduler.grammars
    for n in args.jump_requests:
        prompts = [f"{i}. Write one customer order as JSON." for i in range(n)]
        results = []
        for jump in (False, True):
            grammars.jump_forward = jump
            timed(engine, prompts, params)  # warm-up (and the cache holds the prompts)
            before, jumped = passes[0], grammars.num_jumped_tokens
            seconds, outs = timed(engine, prompts, params)
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
            results.append((seconds, tokens, passes[0] - before,
                            grammars.num_jumped_tokens - jumped, [o["text"] for o in outs]))
        (p_s, p_tok, p_steps, _, p_out), (j_s, j_tok, j_steps, j_jumped, j_out) = results
        rows.append(f"| {n} | {p_s:.2f} s, {p_tok}, {p_steps} | {j_s:.2f} s, {j_tok}, "
                    f"{j_steps}, {j_jumped} | {p_s / j_s:.2f}x | "
                    f"{(p_s / p_tok) / (j_s / j_tok):.2f}x | "
                    f"{sum(a == b for a, b in zip(p_out, j_out))}/{n} |")
    grammars.jump_forward = False
    return rows


def main() -> None:
    args = build_parser().parse_args()
    engine = start_engine(args)
    try:
        print(f"model {args.model_path or 'SmolLM2-135M (bundled)'}, device "
              f"{engine.server_args.device}, {args.steps} steps per run", flush=True)
        print("\n".join(per_step_rows(engine, args)), flush=True)
        print()
        print("\n".join(mask_rows(engine, args)), flush=True)
        print()
        print("\n".join(jump_forward_rows(engine, args)), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
