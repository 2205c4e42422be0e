"""Greedy generation through the Engine (scheduler, radix cache, chunked prefill, overlap)
equals transformers on tiny random checkpoints of the families added on the shared blocks, in
fp32: Qwen3, Gemma-2, Gemma-3, Mistral with a sliding window shorter than the prompts, the MoE families
(Mixtral, Qwen2-MoE, Qwen3-MoE) and DeepSeek-V2 / V3 with MLA.

The reference is transformers' full forward pass, argmax'ed one token at a time (its attention
masks apply the window exactly). `generate` is not the reference: with a sliding-window cache
its decode steps drift from its own full forward (seen at position 135 of a window-32 Mistral,
where the full forward agrees with us)."""
from __future__ import annotations

import pytest
import torch

import radixserve
from tests.models.tiny_checkpoints import make_checkpoint

NEW_TOKENS = 64


def hf_greedy(hf_model, ids: list[int], new_tokens: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


# every checkpoint's logits per pass: tests/models/test_llama_vs_hf.py, in CI; the variants
# of a family here run with --run-slow (2.5-3.6 s each)
@pytest.mark.parametrize("name", [
    "mistral_window32",
    "qwen3_qk_norm",
    "gemma_mqa",
    "gemma2_softcap_window",
    "gemma3_text",
    pytest.param("gemma3_linear_rope", marks=pytest.mark.slow),
    "mixtral_moe",
    "qwen2_moe_shared",
    "qwen3_moe",
    "deepseek_v2_lite_mla",
    pytest.param("deepseek_v2_q_lora", marks=pytest.mark.slow),
    "deepseek_v3_noaux",
    "glm4_moe_partial_rope",
    pytest.param("glm4_moe_lite_mla", marks=pytest.mark.slow),
    "gpt_oss_sinks_window",
    pytest.param("mistral4_mla_halves", marks=pytest.mark.slow),
    "olmo2_post_norm",
    pytest.param("olmo3_window", marks=pytest.mark.slow),
    pytest.param("minimax_m2_qk_norm", marks=pytest.mark.slow),
    pytest.param("cohere2_window", marks=pytest.mark.slow),
    pytest.param("phi3_merged_window", marks=pytest.mark.slow),
    pytest.param("cohere_qk_norm", marks=pytest.mark.slow),
    pytest.param("granite_multipliers", marks=pytest.mark.slow),
    pytest.param("granitemoe_shared", marks=pytest.mark.slow),
    pytest.param("smollm3_nope", marks=pytest.mark.slow)])
def test_greedy_outputs_equal_transformers(name: str, tmp_path) -> None:
    hf_model = make_checkpoint(name, tmp_path)
    gen = torch.Generator().manual_seed(7)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (101, 130)]
    # a third prompt shares the first one's first 90 tokens: served from the radix cache
    prompts.append(prompts[0][:90] + torch.randint(0, vocab, (25,), generator=gen).tolist())
    expected = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]
    engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=4096, chunked_prefill_size=48)
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    first = engine.generate(input_ids=prompts[0], sampling_params=params)
    rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
    got = [first["output_ids"]] + [r["output_ids"] for r in rest]
    assert got == expected
    assert rest[1]["meta_info"]["cached_tokens"] >= 64  # the shared prefix was reused
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
