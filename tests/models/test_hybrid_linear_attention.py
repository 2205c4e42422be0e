"""Hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid: Gated DeltaNet layers;
Nemotron-H, Granite-4.0-H, Bamba, Falcon-H1: Mamba-2 mixers) with per-request recurrent states
beside full attention, against transformers on tiny random checkpoints it saved itself (fp32).
Logits per pass are in test_llama_vs_hf.py (its CONFIGS hold the text ones); here the Engine:
greedy outputs equal transformers' full forward through chunked prefill (states carried from
chunk to chunk), batches of decodes, MIXED passes and retraction (states restarted from
position 0), prefix reuse up to where states were kept, with no KV slot leaked; the multimodal
Qwen3.5-MoE checkpoint served text-only; the gated delta rule's chunked form against its
token-by-token recurrence; the memory split between states and KV."""
from __future__ import annotations

import pytest
import torch

import radixserve
from radixserve.config import ServerArgs
from radixserve.core.model_config import ModelConfig
from radixserve.executor.memory_budget import STATE_SHARE, hybrid_budget
from radixserve.layers.gated_delta_rule import CHUNK, chunked, prepare_qk, recurrent_step
from radixserve.loader.model_source import load_model_source
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.tiny_checkpoints import make_checkpoint

NEW_TOKENS = 40


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (101, 130, 3)]
    # the first one's first 90 tokens again: its states are kept at the first one's chunk
    # ends (48 and 96 tokens; the prefill chunk is 48), so 48 tokens are reused
    prompts.append(prompts[0][:90] + torch.randint(0, vocab, (25,), generator=gen).tolist())
    return prompts


def _generate(folder: str, prompts: list[list[int]], **engine_args: object
              ) -> tuple[list[list[int]], list[int], int]:
    """Greedy outputs (the first prompt alone, then the rest in one batch), the cached
    tokens of each, and the retractions."""
    engine_args = {"max_total_tokens": 4096, **engine_args}
    engine = radixserve.Engine(folder, dtype="float32", skip_tokenizer_init=True,
                               chunked_prefill_size=48, **engine_args)
    try:
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                  "ignore_eos": "schedule_conservativeness" not in engine_args}
        first = engine.generate(input_ids=prompts[0], sampling_params=params)
        rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
        outs = [first] + rest
        state = engine.get_internal_state()
        assert state["memory_check_ok"] and state["leaked_tokens"] == 0
        return ([o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs],
                engine.scheduler.stats.num_retractions)
    finally:
        engine.shutdown()


# the MoE hybrids run with --run-slow (4-6 s each): their MoE blocks are the tested ones
@pytest.mark.parametrize("name", ["qwen3_next_hybrid", "qwen3_5_dense", "olmo_hybrid",
                                  "nemotron_h",
                                  pytest.param("nemotron_h_moe", marks=pytest.mark.slow),
                                  pytest.param("granite_hybrid_moe", marks=pytest.mark.slow),
                                  pytest.param("granite_hybrid_dense", marks=pytest.mark.slow),
                                  pytest.param("bamba", marks=pytest.mark.slow),
                                  pytest.param("falcon_h1", marks=pytest.mark.slow)])
def test_greedy_outputs_equal_transformers(name: str, tmp_path) -> None:
    hf_model = make_checkpoint(name, tmp_path)
    prompts = _prompts(hf_model.config.vocab_size)
    expected = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]
    got, cached, _ = _generate(str(tmp_path), prompts)
    assert got == expected
    assert cached == [0, 0, 0, 48]  # the prefix up to the deepest kept states
    got, cached, _ = _generate(str(tmp_path), prompts, disable_radix_cache=True)
    assert got == expected and cached == [0, 0, 0, 0]


def test_a_conversation_resumes_from_the_states_kept_at_its_end(tmp_path) -> None:
    """The next turn (the prompt, the answer and new tokens) reuses the whole first turn: its
    KV and the states kept when it finished, restored into the new request's row."""
    hf_model = make_checkpoint("qwen3_next_hybrid", tmp_path)
    gen = torch.Generator().manual_seed(9)
    first = torch.randint(0, 150, (70,), generator=gen).tolist()
    engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=4096, chunked_prefill_size=48)
    try:
        params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
        answer = engine.generate(input_ids=first, sampling_params=params)["output_ids"]
        assert answer == hf_greedy(hf_model, first, 20)
        second = first + answer + torch.randint(0, 150, (9,), generator=gen).tolist()
        out = engine.generate(input_ids=second, sampling_params=params)
        assert out["output_ids"] == hf_greedy(hf_model, second, 20)
        assert out["meta_info"]["cached_tokens"] == len(first) + len(answer) - 1
        engine.scheduler.tree_cache.check_invariants()
    finally:
        engine.shutdown()


def test_a_prompt_sent_again_reuses_all_but_its_last_token(tmp_path) -> None:
    """The pass ending a prompt also keeps the states before its last token, which the
    scheduler recomputes for its logits: a repeat reuses everything else, alone and in a
    batch with another prompt."""
    hf_model = make_checkpoint("qwen3_5_dense", tmp_path)
    gen = torch.Generator().manual_seed(4)
    prompt, other = (torch.randint(0, 150, (n,), generator=gen).tolist() for n in (70, 30))
    expected = hf_greedy(hf_model, prompt, 12)
    engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=4096, chunked_prefill_size=48)
    try:
        params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        outs = [engine.generate(input_ids=prompt, sampling_params=params) for _ in range(2)]
        outs += engine.generate(input_ids=[other, prompt], sampling_params=params)
        assert [o["output_ids"] for o in outs] == \
            [expected, expected, hf_greedy(hf_model, other, 12), expected]
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 69, 0, 69]
        state = engine.get_internal_state()
        assert state["memory_check_ok"] and state["leaked_tokens"] == 0
        engine.scheduler.tree_cache.check_invariants()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["qwen3_next_hybrid", "nemotron_h"])
def test_prompts_sharing_a_system_prompt_reuse_it(name: str, tmp_path) -> None:
    """The second prompt with a new 80-token opening parts from the first there: its pass
    runs in two segments and keeps the states at the branch point, so every later prompt
    with that opening (alone or two in a batch) reuses its 80 tokens. Prompts with another
    opening sent together: all but the first wait one batch and reuse it. Outputs stay
    transformers'."""
    hf_model = make_checkpoint(name, tmp_path)
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(0, 150, (80,), generator=gen).tolist()
    prompts = [system + torch.randint(0, 150, (n,), generator=gen).tolist()
               for n in (20, 33, 7, 15, 26)]
    engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=4096, chunked_prefill_size=256)
    try:
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        outs = [engine.generate(input_ids=p, sampling_params=params) for p in prompts[:3]]
        outs += engine.generate(input_ids=prompts[3:], sampling_params=params)
        # a new opening sent by three prompts at once: the first computes it and keeps the
        # states where the others part from it; they wait one batch and reuse it
        burst = [system[::-1] + p[80:] for p in prompts[:3]]
        outs += engine.generate(input_ids=burst, sampling_params=params)
        assert [o["output_ids"] for o in outs] == \
            [hf_greedy(hf_model, p, 8) for p in prompts + burst]
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0, 80, 80, 80, 0, 80, 80]
        state = engine.get_internal_state()
        assert state["memory_check_ok"] and state["leaked_tokens"] == 0
        engine.scheduler.tree_cache.check_invariants()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["qwen3_next_hybrid", "nemotron_h"])
def test_mixed_passes_and_retraction_keep_the_outputs(name: str, tmp_path) -> None:
    """Decodes riding in prefill chunks (--enable-mixed-chunk), then a KV pool so small that
    over-admitted requests are retracted and start again from position 0 (their states
    restarted, or restored from the states kept when they were retracted). Each output is
    transformers' up to its EOS, if one came."""
    hf_model = make_checkpoint(name, tmp_path)
    prompts = _prompts(hf_model.config.vocab_size)
    expected = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]
    got, _, _ = _generate(str(tmp_path), prompts, enable_mixed_chunk=True)
    assert got == expected
    got, _, retractions = _generate(str(tmp_path), prompts, max_total_tokens=200,
                                    schedule_conservativeness=0.05)
    assert retractions > 0
    for out, ref in zip(got, expected):
        assert out == ref[:len(out)] and out


def test_qwen3_5_moe_multimodal_serves_its_language_model(tmp_path) -> None:
    from radixserve.models.registry import model_class
    hf_model = make_checkpoint("qwen3_5_moe_multimodal", tmp_path)
    config: ModelConfig = load_model_source(str(tmp_path), "auto").model_config
    assert model_class(config).__name__ == "Qwen3_5ForConditionalGeneration"
    prompts = _prompts(hf_model.config.text_config.vocab_size)[:2]
    expected = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]
    got, _, _ = _generate(str(tmp_path), prompts)
    assert got == expected


@pytest.mark.parametrize("lengths", [(1, 64, 65), (200, 7)])
def test_chunked_rule_equals_the_recurrence(lengths: tuple[int, ...]) -> None:
    """Sequences padded to a common multiple of CHUNK (2 key heads serving 4 value heads),
    from random states: outputs and final states equal the token-by-token recurrence."""
    gen = torch.Generator().manual_seed(0)
    heads, key_dim, value_dim = 4, 8, 6
    padded = -(-max(lengths) // CHUNK) * CHUNK
    q = torch.zeros(len(lengths), padded, heads, key_dim)
    k, v = torch.zeros_like(q), torch.zeros(len(lengths), padded, heads, value_dim)
    g, beta = torch.zeros(len(lengths), padded, heads), torch.zeros(len(lengths), padded, heads)
    start = torch.randn(len(lengths), heads, key_dim, value_dim, generator=gen)
    outs, states = [], []
    for r, n in enumerate(lengths):
        qr, kr = prepare_qk(torch.randn(n, 2, key_dim, generator=gen),
                            torch.randn(n, 2, key_dim, generator=gen), 2)
        vr = torch.randn(n, heads, value_dim, generator=gen)
        gr = -torch.rand(n, heads, generator=gen) * 0.2
        br = torch.rand(n, heads, generator=gen)
        q[r, :n], k[r, :n], v[r, :n], g[r, :n], beta[r, :n] = qr, kr, vr, gr, br
        state, steps = start[r:r + 1], []
        for t in range(n):
            o, state = recurrent_step(qr[t:t + 1], kr[t:t + 1], vr[t:t + 1], gr[t:t + 1],
                                      br[t:t + 1], state)
            steps.append(o[0])
        outs.append(torch.stack(steps))
        states.append(state[0])
    out, final = chunked(q, k, v, g, beta, start)
    for r, n in enumerate(lengths):
        torch.testing.assert_close(out[r, :n], outs[r], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[r], states[r], atol=1e-4, rtol=1e-4)


def test_states_and_kv_share_the_budget() -> None:
    """Rows capped where their states and as many snapshots would pass STATE_SHARE of the
    budget; snapshots past one per row where the share has room; the KV pool gets what the
    states leave; --max-running-requests sets the rows; a row too large is refused."""
    args = ServerArgs(model_path="x", device="cpu", cpu_kv_cache_bytes=1 << 30).resolve()
    cpu, row = torch.device("cpu"), 16 << 20
    share = int((1 << 30) * STATE_SHARE)
    plan = hybrid_budget(args, 1024, row, cpu)
    assert plan.rows == (share - row) // row and plan.snapshots == 0
    assert plan.kv_tokens == ((1 << 30) - (plan.rows + 1) * row) // 1024
    plan = hybrid_budget(args, 1024, row, cpu, prefix_cache=True)
    assert plan.rows == (share - row) // (2 * row)
    assert plan.snapshots == share // row - plan.rows - 1 >= plan.rows
    args.max_running_requests = 3  # the share's room goes to snapshots
    plan = hybrid_budget(args, 1024, row, cpu, prefix_cache=True)
    assert (plan.rows, plan.snapshots) == (3, share // row - 4)
    assert plan.kv_tokens == ((1 << 30) - (4 + plan.snapshots) * row) // 1024
    args.max_running_requests = None
    with pytest.raises(RuntimeError, match="recurrent states"):
        hybrid_budget(args, 1024, 1 << 30, cpu)
