"""Speculative decoding with n-gram drafts against plain decoding, on tasks whose answers copy
their prompt (the bundled SmolLM2 by default: repeating a paragraph, editing code).

    python3 benchmarks/spec_ngram.py --batch-size 1 4 --max-new-tokens 160
    python3 benchmarks/spec_ngram.py --task free   # open answers: what failed drafts cost
    python3 benchmarks/spec_ngram.py --model-path benchmarks/configs/llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --synthetic   # GPU: the verify step's cost

Per batch size and mode: output tokens per second over the timed generate call (after one
warm-up request), decode passes, tokens a request gains per pass (accept len), and whether
the outputs equal plain decoding's (greedy). Engine flags not named here pass through as
--engine-arg KEY=VALUE.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import radixserve
from radixserve.config import DEFAULT_MODEL_NAME

PARAGRAPHS = (Path(__file__).resolve().parent.parent / "tests" / "data"
              / "english_paragraphs.txt").read_text().split("\n\n")
CODE = '''def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order.status == "paid":
            total += order.amount
            count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}
'''


FREE_TASKS = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
              "Explain why the sky is blue to a ten-year-old.",
              "Give five ideas for a rainy weekend, with a sentence on each.",
              "Describe the life cycle of a butterfly.")


def conversations(task: str) -> list[list[dict[str, str]]]:
    """copy: answers that repeat or edit their prompt (where drafts hit); free: open
    answers (where few do: the cost of verifying drafts that fail)."""
    if task == "free":
        tasks = list(FREE_TASKS)
    else:
        tasks = [f"Repeat the following text exactly, word for word:\n\n{p.strip()}"
                 for p in PARAGRAPHS if p.strip()]
        tasks.append("Rewrite this Python function so that the variable `total` is called "
                     f"`revenue`. Return only the code.\n\n```python\n{CODE}```")
    return [[{"role": "user", "content": t}] for t in tasks]


def synthetic_prompts(count: int) -> list[list[int]]:
    """Token prompts for models without a tokenizer: a motif repeated inside random ids."""
    import random
    rng = random.Random(0)
    out = []
    for _ in range(count):
        motif = [rng.randrange(100, 20000) for _ in range(24)]
        out.append([rng.randrange(100, 20000) for _ in range(200)] + motif * 8)
    return out


def run(args: argparse.Namespace, spec: bool, batch: int) -> dict:
    engine_args = dict(kv.split("=", 1) for kv in args.engine_arg)
    for key, value in list(engine_args.items()):
        engine_args[key] = json.loads(value) if value[:1].isdigit() or value in (
            "true", "false") else value
    if spec:
        engine_args.update(speculative_algorithm="ngram",
                           speculative_num_draft_tokens=args.num_draft,
                           speculative_ngram_min_match_window_size=args.min_match,
                           speculative_ngram_max_match_window_size=args.max_match)
    if args.load_format:
        engine_args["load_format"] = args.load_format
    if args.dtype:
        engine_args["dtype"] = args.dtype
    engine = radixserve.Engine(args.model_path, skip_tokenizer_init=args.synthetic,
                               **engine_args)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    if args.synthetic:
        prompts = synthetic_prompts(batch)
        call = lambda ps: engine.generate(input_ids=ps, sampling_params=params)  # noqa: E731
    else:
        convs = conversations(args.task)
        prompts = [convs[i % len(convs)] for i in range(batch)]
        call = lambda ps: engine.chat(ps, sampling_params=params)  # noqa: E731
    call(prompts[:1])  # warm-up (graphs, kernels, allocator)
    engine.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 1})
    before = engine.get_internal_state()
    start = time.perf_counter()
    outs = call(prompts)
    wall = time.perf_counter() - start
    state = engine.get_internal_state()
    engine.shutdown()
    tokens = sum(len(o["output_ids"]) for o in outs)
    steps = state["num_decode_steps"] - before["num_decode_steps"]
    return {"mode": "ngram" if spec else "plain", "batch": batch, "tokens": tokens,
            "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 1),
            "decode_passes": steps, "accept_len": round(state["spec_accept_length"], 2),
            "ids": [o["output_ids"] for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--synthetic", action="store_true",
                        help="token prompts (a repeated motif), no tokenizer")
    parser.add_argument("--task", choices=("copy", "free"), default="copy")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--min-match", type=int, default=2)
    parser.add_argument("--max-match", type=int, default=8)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for batch in args.batch_size:
        plain = run(args, False, batch)
        spec = run(args, True, batch)
        spec["same_outputs"] = spec["ids"] == plain["ids"]
        spec["speedup"] = round(spec["tok_per_s"] / plain["tok_per_s"], 3)
        for row in (plain, spec):
            print({k: v for k, v in row.items() if k != "ids"}, flush=True)
            rows.append({k: v for k, v in row.items() if k != "ids"})
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
