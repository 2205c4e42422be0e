"""Chunked prefill (and mixed passes) leave greedy outputs unchanged on tiny random checkpoints,
including prompts that share a cached prefix split by a chunk boundary."""
from __future__ import annotations

import pytest
import torch

import radixserve
from tests.models.tiny_checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_gqa_chunked")
    make_checkpoint("llama_gqa_llama3_rope", folder)
    return str(folder)


def _outputs(checkpoint: str, **args) -> list[list[int]]:
    engine = radixserve.Engine(checkpoint, dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=6000, **args)
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 160, (45,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 160, (n,), generator=gen).tolist() for n in (3, 30, 70)]
    prompts.append(torch.randint(0, 160, (150,), generator=gen).tolist())
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    first = engine.generate(input_ids=prompts[:1], sampling_params=params)  # cache the shared part
    rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    return [o["output_ids"] for o in first + rest]


def test_chunking_keeps_greedy_outputs(checkpoint):
    reference = _outputs(checkpoint, chunked_prefill_size=-1)
    for chunk, mixed in ((16, False), (16, True), (64, False), (1024, True)):
        assert _outputs(checkpoint, chunked_prefill_size=chunk,
                        enable_mixed_chunk=mixed) == reference, (chunk, mixed)
