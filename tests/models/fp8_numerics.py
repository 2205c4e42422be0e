"""FP8 against the compute dtype on the bundled SmolLM2 (real weights, CPU): the per-token
log-likelihood of natural English paragraphs, greedy agreement, and a chat answer. Shared by
the FP8 tests and `benchmarks/fp8_numerics.py`, which prints the figures."""
from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

PARAGRAPHS = (Path(__file__).parents[1] / "data" / "english_paragraphs.txt").read_text()
PROMPTS = ["The history of the printing press", "def fibonacci(n):",
           "Three reasons to learn a second language are", "Once upon a time, in a small"]


class Numerics(NamedTuple):
    token_logprobs: list[list[float]]  # per paragraph, per scored token
    greedy: list[list[int]]  # per prompt
    answer: str


def measure(engine: Any, new_tokens: int = 48) -> Numerics:
    logprobs = []
    for paragraph in PARAGRAPHS.strip().split("\n\n"):
        out = engine.generate(paragraph, {"max_new_tokens": 1, "temperature": 0},
                              return_logprob=True, logprob_start_len=0)
        logprobs.append([lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]])
    outs = engine.generate(PROMPTS, {"max_new_tokens": new_tokens, "temperature": 0,
                                     "ignore_eos": True})
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
        add_generation_prompt=True)
    answer = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})["text"]
    return Numerics(logprobs, [o["output_ids"] for o in outs], answer)


def compare(base: Numerics, other: Numerics) -> dict[str, float]:
    diffs = torch.cat([torch.tensor(a) - torch.tensor(b)
                       for a, b in zip(base.token_logprobs, other.token_logprobs)])
    same = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(base.greedy, other.greedy))
    total = sum(len(a) for a in base.greedy)
    return {"mean_abs_logprob_diff": float(diffs.abs().mean()),
            "max_abs_logprob_diff": float(diffs.abs().max()),
            "mean_logprob_shift": float(diffs.mean()),
            "scored_tokens": float(diffs.numel()),
            "greedy_agreement": same / total}
