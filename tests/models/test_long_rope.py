"""LongRoPE (core/long_rope.py: Phi-3.5-mini, Phi-4-mini, Phi-3-mini-128k) against transformers,
on a tiny Phi-3 checkpoint with a 64-token original context, far-apart factor sets and
Phi-4-mini's partial rotary.

transformers rotates a sequence of L tokens with the short factors while L <= 64 and with the
long ones past it, and drops its KV cache when generation first passes 64 tokens (Phi-3's
`prepare_inputs_for_generation`), so its greedy tokens are those of a full forward pass per
step: `hf_greedy` is the reference."""
from __future__ import annotations

import pytest
import torch

import radixserve
from radixserve.core.long_rope import LongRopeSwitch
from radixserve.core.model_config import ModelConfig
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.layers.rotary import RotaryEmbedding
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.tiny_checkpoints import make_checkpoint

ORIGINAL = 64  # the tiny checkpoint's original_max_position_embeddings
NEW_TOKENS = 24
SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4,
            speculative_ngram_min_match_window_size=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("phi3_longrope")
    return folder, make_checkpoint("phi3_longrope", folder)


def test_tables_equal_transformers_rows(checkpoint) -> None:
    """Rows [0, P) are transformers' cos / sin for a sequence within the original context,
    rows [P, 2P) those for one past it (attention factor included)."""
    folder, hf_model = checkpoint
    config = ModelConfig.from_path(str(folder))
    config.context_length = config.max_position_embeddings
    switch = LongRopeSwitch.from_config(config)
    assert switch == LongRopeSwitch(ORIGINAL, 512)
    table = RotaryEmbedding.from_config(config)
    assert table.cos_cache.shape == (1024, 12)
    for length, first_row in ((ORIGINAL, 0), (ORIGINAL + 1, 512), (300, 512)):
        positions = torch.arange(length)[None]
        cos, sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
        torch.testing.assert_close(table.cos_cache[first_row:first_row + length], cos[0])
        torch.testing.assert_close(table.sin_cache[first_row:first_row + length], sin[0])


def test_switch_rule() -> None:
    """A request starts on the long table past the original context, moves there when its
    next token would pass it (or the one after, with a step in flight), and its drafts stay
    within the short table; the prefix cache keys of the two tables differ."""
    switch = LongRopeSwitch(original_positions=ORIGINAL, long_table_row=512)
    params = SamplingParams(max_new_tokens=8)
    short, long = Req("a", list(range(ORIGINAL)), params), Req("b", list(range(65)), params)
    switch.place(short)
    switch.place(long)
    assert (short.rope_table_shift, long.rope_table_shift) == (0, 512)
    assert long.rope_shift(0) == 512 and not switch.due(long, ahead=5)
    assert not switch.due(short) and switch.due(short, ahead=1)
    assert switch.draft_room(short) == 0
    short_key = short.cache_key(list(range(10)))
    short.output_ids.append(7)
    assert switch.due(short)
    switch.place(short)
    assert short.rope_table_shift == 512 and short.cache_key(list(range(10))) != short_key
    assert switch.draft_room(Req("c", list(range(60)), params)) == 4


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(8)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=gen).tolist()  # noqa: E731
    # short; generation passes 64 tokens at its 10th new token, and the 14 tokens after it
    # would differ if it went on with the short table (the seed gives a prompt whose
    # greedy tokens do not settle into a loop of one token)
    crossing = rand(56)
    return [crossing, rand(100), crossing[:30] + rand(45), rand(20)]


@pytest.mark.parametrize("flags", [pytest.param({}, id="overlap"),
                                   pytest.param({"disable_overlap_schedule": True},
                                                id="sync", marks=pytest.mark.slow),
                                   pytest.param(SPEC, id="ngram", marks=pytest.mark.slow)])
def test_greedy_equals_transformers_across_the_switch(checkpoint, flags) -> None:
    """Prompts short, long and crossing the original context during generation, chunked in
    16s; then prompts whose prefixes only the other table's KV holds (not reused), and one
    whose prefix the short table's KV holds (reused)."""
    folder, hf_model = checkpoint
    vocab = hf_model.config.vocab_size
    *prompts, stays_short = _prompts(vocab)  # stays_short: 20 + 8 tokens, short-table KV
    long_over_short = stays_short + prompts[1][:60]  # 80 tokens: may not use that KV
    engine = radixserve.Engine(str(folder), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=4096, chunked_prefill_size=16, **flags)
    try:
        greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        first = engine.generate(input_ids=prompts[0], sampling_params=greedy)
        rest = engine.generate(input_ids=prompts[1:], sampling_params=greedy)
        got = [first["output_ids"]] + [r["output_ids"] for r in rest]
        assert got == [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]

        few = dict(greedy, max_new_tokens=8)
        engine.generate(input_ids=stays_short, sampling_params=few)
        over = engine.generate(input_ids=long_over_short, sampling_params=few)
        again = engine.generate(input_ids=stays_short + [5, 6], sampling_params=few)
        assert over["output_ids"] == hf_greedy(hf_model, long_over_short, 8)
        assert again["output_ids"] == hf_greedy(hf_model, stays_short + [5, 6], 8)
        assert over["meta_info"]["cached_tokens"] == 0
        assert again["meta_info"]["cached_tokens"] >= 20
        state = engine.get_internal_state()
        assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    finally:
        engine.shutdown()


def test_longrope_per_layer_type_refused() -> None:
    """longrope has one table per model: a per-layer-type longrope config is refused."""
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf_dict({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "vocab_size": 160, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "longrope", "rope_theta": 10000.0,
                                   "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                   "original_max_position_embeddings": 64}}})
