"""Gemma-3 text models (Gemma3ForCausalLM) against transformers on tiny random checkpoints in
fp32: each layer's rope table and window, and every prefill position's logits of prompts longer
than the sliding window. Decode, extend on a cached prefix and mixed batches are checked for
every tiny config by test_llama_vs_hf.py, greedy generation through the Engine by
test_greedy_vs_hf.py.

"gemma3_text" has the default layer_types (five sliding layers, one full) and default ropes
(local base 10k, global 1M); "gemma3_linear_rope" alternates the two kinds, with linear scaling
on the full layers' rope only and a local base of its own, as the 4b-27b configs do."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.config import ServerArgs
from radixserve.core.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.executor.model_runner import ModelRunner
from tests.models.tiny_checkpoints import make_checkpoint

CASES = ["gemma3_text", "gemma3_linear_rope"]
ATOL = 2e-4


@pytest.fixture(scope="module", params=CASES)
def checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    return make_checkpoint(request.param, folder), folder


@pytest.fixture(scope="module")
def pair(checkpoint) -> tuple[torch.nn.Module, ModelRunner]:
    hf_model, folder = checkpoint
    return hf_model, ModelRunner(ServerArgs(model_path=str(folder), dtype="float32",
                                            device="cpu", max_total_tokens=4096,
                                            max_running_requests=8))


def hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits of the prompts prefilled together in one EXTEND pass."""
    rows = runner.req_to_token_pool.alloc(len(prompts))
    lens = [len(p) for p in prompts]
    out_loc = runner.token_to_kv_pool.alloc(sum(lens))
    offset = 0
    for row, n in zip(rows, lens):
        runner.req_to_token_pool.write(row, 0, out_loc[offset:offset + n])
        offset += n
    batch = ModelWorkerBatch(
        forward_mode=ForwardMode.EXTEND, input_ids=[t for p in prompts for t in p],
        req_pool_indices=rows, seq_lens=lens, out_cache_loc=out_loc, extend_seq_lens=lens,
        extend_prefix_lens=[0] * len(prompts), return_logprob=True,
        extend_logprob_start_lens=[0] * len(prompts))
    extend_logits = runner.forward_logits(batch).extend_logits
    assert extend_logits is not None
    return list(extend_logits.split(lens))


def test_each_layer_has_its_types_window_and_rope(pair) -> None:
    hf_model, runner = pair
    config = hf_model.config
    positions = torch.arange(300)
    for i, layer in enumerate(runner.model.model.layers):
        kind = config.layer_types[i]
        attn = layer.self_attn
        assert attn.attn.sliding_window == (config.sliding_window
                                            if kind == "sliding_attention" else None)
        cos, sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32),
                                             positions[None], kind)
        torch.testing.assert_close(attn.rotary.cos_cache[positions], cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(attn.rotary.sin_cache[positions], sin[0], atol=1e-6, rtol=0)
    assert {"sliding_attention", "full_attention"} <= set(config.layer_types)


def test_prefill_logits_match_transformers(pair) -> None:
    hf_model, runner = pair
    gen = torch.Generator().manual_seed(1)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (13, 70, 130)]
    for ours, ids in zip(prefill_logits(runner, prompts), prompts):
        torch.testing.assert_close(ours, hf_logits(hf_model, ids), atol=ATOL, rtol=1e-4)
