"""Greedy tokens of a few requests decoded together through the Engine, for tests that compare
a decode path against another on a tiny checkpoint (tests/models/tiny_checkpoints.py)."""
from __future__ import annotations

import torch

import radixserve


def engine_greedy_tokens(checkpoint: str, prompt_lengths: tuple[int, ...], new_tokens: int,
                         **engine_args) -> list[list[int]]:
    """Requests of random ids (the tiny checkpoints' 160-token vocabulary, seed 3) of these
    lengths, `new_tokens` greedy tokens each; the Engine's memory accounting is checked (no
    leaked KV slot) before it shuts down."""
    engine = radixserve.Engine(checkpoint, skip_tokenizer_init=True, max_total_tokens=2000,
                               **engine_args)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in prompt_lengths]
    outs = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    engine.shutdown()
    return [out["output_ids"] for out in outs]
