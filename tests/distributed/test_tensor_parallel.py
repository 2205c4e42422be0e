"""Tensor parallelism on CPU (gloo, one process per rank): --tp-size 2 gives transformers'
greedy outputs and tp 1's tokens, logprobs and seeded samples, on tiny random checkpoints
covering GQA split, KV-head replication (1 KV head, 2 ranks), q/k/v bias, q/k norms, tied
embeddings with soft-capping and sliding windows; FP8 at tp 2 (block-scaled checkpoints whose
input columns split inside a block, a dense and an MoE model; --quantization fp8 with an FP8
KV cache) gives tp 1's outputs, and so does tp 4 (--run-slow); the real server runs with
--tp-size 2 and a dying rank takes it down; splits the layers cannot make are refused before
loading; constrained outputs (regex, JSON schema) at tp 2 equal tp 1's."""
from __future__ import annotations

import os
import signal

import pytest
import requests
import torch

import radixserve
from tests.loader.test_fp8_checkpoints import _write_pair
from tests.models.int4_checkpoints import write_int4_pair
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.tiny_checkpoints import make_checkpoint
from tests.server.server_process import ServerProcess, wait_gone

NEW_TOKENS = 12


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 40, 90)]


def _run(folder: str, tp_size: int, prompts: list[list[int]], **engine_args: object) -> dict:
    engine = radixserve.Engine(folder, dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=2048, tp_size=tp_size, chunked_prefill_size=32,
                               **engine_args)
    try:
        greedy = engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
            return_logprob=True, top_logprobs_num=3)
        sampled = engine.generate(input_ids=prompts[1], sampling_params={
            "max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 11,
            "frequency_penalty": 0.5})
        state = engine.get_internal_state()
        assert state["memory_check_ok"] and state["leaked_tokens"] == 0
        return {"ids": [g["output_ids"] for g in greedy],
                "logprobs": [[lp for lp, _ in g["meta_info"]["output_token_logprobs"]]
                             for g in greedy],
                "sampled": sampled["output_ids"], "accept_len": state["spec_accept_length"]}
    finally:
        engine.shutdown()


# qwen2_moe_shared carries q/k/v bias too, so qwen2_bias runs with --run-slow; llama covers
# mistral's GQA, minimax_m2 GLM's partial rope with sigmoid routing and OLMo-2's
# whole-projection norms (olmo_hybrid OLMo's attention), deepseek_v3 MLA (V2-Lite's and
# Mistral-4's differ from it per token, not per rank)
@pytest.mark.parametrize("name", ["llama_gqa_llama3_rope",
                                  pytest.param("mistral_gqa", marks=pytest.mark.slow),
                                  pytest.param("qwen2_bias", marks=pytest.mark.slow),
                                  pytest.param("gemma2_softcap_window",
                                               marks=pytest.mark.slow),
                                  pytest.param("qwen2_moe_shared", marks=pytest.mark.slow),
                                  pytest.param("deepseek_v2_lite_mla", marks=pytest.mark.slow),
                                  "deepseek_v3_noaux",
                                  pytest.param("glm4_moe_partial_rope", marks=pytest.mark.slow),
                                  pytest.param("gpt_oss_sinks_window", marks=pytest.mark.slow),
                                  pytest.param("mistral4_mla_halves", marks=pytest.mark.slow),
                                  "qwen3_next_hybrid",
                                  pytest.param("qwen3_5_dense", marks=pytest.mark.slow),
                                  # qwen3_next_hybrid's Gated DeltaNet covers OLMo-Hybrid's
                                  pytest.param("olmo_hybrid", marks=pytest.mark.slow),
                                  pytest.param("olmo2_post_norm", marks=pytest.mark.slow),
                                  pytest.param("minimax_m2_qk_norm", marks=pytest.mark.slow),
                                  pytest.param("nemotron_h", marks=pytest.mark.slow),
                                  # granite_hybrid_moe's one B/C group covers its case
                                  pytest.param("nemotron_h_one_group", marks=pytest.mark.slow),
                                  pytest.param("granite_hybrid_moe", marks=pytest.mark.slow),
                                  pytest.param("nemotron_h_moe", marks=pytest.mark.slow),
                                  pytest.param("nemotron_h_latent_moe",
                                               marks=pytest.mark.slow),
                                  pytest.param("falcon_h1", marks=pytest.mark.slow),
                                  pytest.param("falcon_h1_expand", marks=pytest.mark.slow),
                                  # merged q|k|v and gate|up split by piece, then by rank
                                  pytest.param("phi3_merged_window", marks=pytest.mark.slow),
                                  # LongRoPE: the 90-token prompt on the long table
                                  pytest.param("phi3_longrope", marks=pytest.mark.slow),
                                  # PhiMoE: the LM head's bias split by vocabulary rows
                                  pytest.param("phimoe_longrope", marks=pytest.mark.slow),
                                  # rope pairs permuted per head, then heads split
                                  pytest.param("llama4_maverick", marks=pytest.mark.slow),
                                  # per-head q / k norms cut to each rank's heads
                                  pytest.param("cohere_qk_norm", marks=pytest.mark.slow),
                                  pytest.param("granitemoe_shared", marks=pytest.mark.slow)])
def test_tp2_matches_tp1_and_transformers(name: str, tmp_path) -> None:
    hf_model = make_checkpoint(name, tmp_path)
    prompts = _prompts(hf_model.config.vocab_size)
    one, two = _run(str(tmp_path), 1, prompts), _run(str(tmp_path), 2, prompts)
    assert two["ids"] == one["ids"] == [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    torch.testing.assert_close(torch.tensor(two["logprobs"]), torch.tensor(one["logprobs"]),
                               atol=1e-4, rtol=1e-4)
    assert two["sampled"] == one["sampled"]


def _assert_same_outputs(two: dict, one: dict) -> None:
    assert two["ids"] == one["ids"]
    torch.testing.assert_close(torch.tensor(two["logprobs"]), torch.tensor(one["logprobs"]),
                               atol=1e-4, rtol=1e-4)
    assert two["sampled"] == one["sampled"]


# with --run-slow (12 s): tests/layers/test_fp8_tp_scales.py checks the split scales in CI
@pytest.mark.parametrize("name", [pytest.param("llama_gqa_llama3_rope", marks=pytest.mark.slow),
                                  pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_fp8_blocks_split_inside_a_block_at_tp2(name: str, tmp_path) -> None:
    """Blocks of 32 columns: at tp 2 each rank holds 48 of the dense down projection's 96
    input columns, or 16 of an expert's 32, so ranks keep groups of 16 columns."""
    fp8_folder, twin_folder = _write_pair(tmp_path, "block", name)
    prompts = _prompts(160)
    one, two = _run(str(fp8_folder), 1, prompts), _run(str(fp8_folder), 2, prompts)
    _assert_same_outputs(two, one)
    assert one["ids"] == _run(str(twin_folder), 1, prompts)["ids"]


@pytest.mark.parametrize("method,act_order,model", [
    pytest.param("gptq", True, "llama_gqa_llama3_rope", marks=pytest.mark.slow),  # 11 s
    pytest.param("awq", False, "llama_gqa_llama3_rope", marks=pytest.mark.slow),
    pytest.param("compressed-tensors", False, "qwen3_moe", marks=pytest.mark.slow)])
def test_int4_checkpoints_at_tp2(method: str, act_order: bool, model: str, tmp_path) -> None:
    """Groups of 16: at tp 2 the down projection's 48 input features a rank are 3 groups (an
    expert's 32: one each). GPTQ act-order: the row-parallel ranks hold features of every
    group (dequantised after loading), the column-parallel ones permute their input."""
    folder, twin = write_int4_pair(tmp_path, method, model, group=16,
                                   symmetric=method == "gptq", act_order=act_order)
    prompts = _prompts(160)
    one = _run(str(folder), 1, prompts)
    _assert_same_outputs(_run(str(folder), 2, prompts), one)
    assert one["ids"] == _run(str(twin), 1, prompts)["ids"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["channel", "tensor"])
def test_compressed_tensors_fp8_at_tp2(fmt: str, tmp_path) -> None:
    fp8_folder, _ = _write_pair(tmp_path, fmt, "llama_gqa_llama3_rope")
    prompts = _prompts(160)
    _assert_same_outputs(_run(str(fp8_folder), 2, prompts), _run(str(fp8_folder), 1, prompts))


@pytest.mark.parametrize("name", ["llama_gqa_llama3_rope",
                                  pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_online_fp8_with_an_fp8_kv_cache_at_tp2(name: str, tmp_path) -> None:
    """Each rank's KV heads calibrate the FP8 pool, and --quantization fp8 scales the rows of
    the down projections that a rank holds a part of: both as at tp 1."""
    make_checkpoint(name, tmp_path)
    prompts = _prompts(160)
    fp8 = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    _assert_same_outputs(_run(str(tmp_path), 2, prompts, **fp8),
                         _run(str(tmp_path), 1, prompts, **fp8))


@pytest.mark.slow
@pytest.mark.parametrize("name, engine_args", [
    ("llama_gqa_llama3_rope", dict(quantization="fp8", kv_cache_dtype="fp8_e4m3")),
    ("qwen3_moe", {}), ("deepseek_v2_lite_mla", {}), ("nemotron_h_moe", {})])
def test_tp4_matches_tp1(name: str, engine_args: dict, tmp_path) -> None:
    """Four ranks, as issue 18's tp 8 in small: one query head a rank, each of the two KV heads
    replicated on two ranks (or MLA's latent on all four), experts split four ways; Mamba-2's
    two groups of B/C each replicated on two ranks, the gated norm's groups spanning them."""
    make_checkpoint(name, tmp_path)
    prompts = _prompts(160)
    _assert_same_outputs(_run(str(tmp_path), 4, prompts, **engine_args),
                         _run(str(tmp_path), 1, prompts, **engine_args))


def test_splits_the_layers_cannot_make_are_refused(tmp_path) -> None:
    make_checkpoint("llama_gqa_llama3_rope", tmp_path)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                          max_total_tokens=256, tp_size=3)
    with pytest.raises(ValueError, match="tp-size must be >= 1"):
        radixserve.Engine(str(tmp_path), tp_size=0)


@pytest.mark.slow  # 10 s; a tp 2 server's follower stopped: test_turn_watchdog.py, in CI
def test_server_with_tp2_serves_and_a_dead_rank_takes_it_down(tmp_path) -> None:
    make_checkpoint("qwen3_qk_norm", tmp_path)
    server = ServerProcess("--model-path", str(tmp_path), "--tp-size", "2", "--dtype",
                           "float32", "--skip-tokenizer-init", "--max-total-tokens", "1024")
    try:
        body = {"input_ids": list(range(1, 30)),
                "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        first = requests.post(server.url("/generate"), json=body, timeout=120)
        assert first.status_code == 200, first.text
        again = requests.post(server.url("/generate"), json=body, timeout=120).json()
        assert again["output_ids"] == first.json()["output_ids"]
        assert again["meta_info"]["cached_tokens"] > 0
        bad = requests.post(server.url("/generate"), json={**body, "input_ids": [10 ** 6]},
                            timeout=60)
        assert bad.status_code == 400
        info = server.server_info()
        assert info["server_args"]["tp_size"] == 2 and len(info["tp_follower_pids"]) == 1
        follower = info["tp_follower_pids"][0]
        os.kill(follower, signal.SIGKILL)
        server.proc.wait(timeout=60)
        assert server.proc.returncode not in (0, None)
        assert "the tp1 process died" in server.log_text()
        assert wait_gone(info["scheduler_pid"]) and wait_gone(info["detokenizer_pid"])
    finally:
        server.stop()



@pytest.mark.slow  # 25 s; the nodes' rendezvous and checks: test_rendezvous.py, in CI
def test_two_node_launch_on_one_host(tmp_path) -> None:
    """--nnodes 2: node 0 serves HTTP with rank 0, node 1 (a second launch) runs rank 1
    headless; outputs equal one rank's; node 1 ends cleanly (exit status 0) when node 0 is
    stopped."""
    import subprocess
    import sys

    from tests.server.server_process import REPO_ROOT, free_port

    hf_model = make_checkpoint("llama_gqa_llama3_rope", tmp_path)
    common = ["--model-path", str(tmp_path), "--tp-size", "2", "--nnodes", "2",
              "--dist-init-addr", f"127.0.0.1:{free_port()}", "--dtype", "float32",
              "--skip-tokenizer-init", "--max-total-tokens", "1024"]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "radixserve.launch_server", *common,
                              "--node-rank", "1"], cwd=REPO_ROOT, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
    try:
        server = ServerProcess(*common, "--node-rank", "0")
        try:
            prompt = _prompts(hf_model.config.vocab_size)[1]
            out = requests.post(server.url("/generate"), json={
                "input_ids": prompt, "sampling_params": {"max_new_tokens": 8,
                                                         "temperature": 0}}, timeout=120)
            assert out.status_code == 200, out.text
            assert out.json()["output_ids"] == hf_greedy(hf_model, prompt, 8)
            assert node1.poll() is None  # still following
        finally:
            assert server.stop() == 0
        # node 0's scheduler told rank 1 to stop: node 1 ends cleanly, not on a broken link
        assert node1.wait(timeout=60) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
        log.close()
    node1_log = (tmp_path / "node1.log").read_text()
    assert "ranks [1] following node 0" in node1_log
    assert "exit code" not in node1_log and "Traceback" not in node1_log, node1_log


@pytest.mark.slow  # 16 s
def test_an_engine_never_shut_down_exits_cleanly(tmp_path) -> None:
    """A script that leaves a tp 2 Engine to the interpreter's exit: multiprocessing ends the
    followers then, which the follower watch must not take for a rank's death (it logged
    "rank died" and made the script exit 1)."""
    import subprocess
    import sys
    folder = tmp_path / "model"
    make_checkpoint("llama_gqa_llama3_rope", folder)
    script = tmp_path / "left_open.py"
    script.write_text(
        "import radixserve\n"
        "if __name__ == '__main__':\n"
        f"    e = radixserve.Engine({str(folder)!r}, dtype='float32', skip_tokenizer_init=True,\n"
        "                          max_total_tokens=512, tp_size=2)\n"
        "    print(e.generate(input_ids=[1, 2, 3], sampling_params={'max_new_tokens': 2})\n"
        "          ['output_ids'])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(os.path.dirname(os.path.dirname(radixserve.__file__))),
         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "died" not in done.stderr


@pytest.mark.slow  # 14 s; grammars on one rank: tests/e2e/test_constrained_engine.py, in CI
def test_constrained_outputs_at_tp2_equal_tp1(tmp_path) -> None:
    """Grammars at tp 2 over gloo: each rank compiles its own, rank 0 says when they are ready
    (scheduler/replicated.py), and the ranks' masks and samples agree with one rank's."""
    import json
    import re

    import transformers

    from radixserve.loader.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(None)  # the bundled model's (49,152 ids)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    schema = {"type": "object", "properties": {"id": {"enum": [7, 42]}},
              "required": ["id"], "additionalProperties": False}
    params = [{"max_new_tokens": 24, "temperature": 0, "regex": "[a-z]{3}-[0-9]{2}"},
              {"max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(schema)},
              {"max_new_tokens": 6, "temperature": 0}]
    texts = {}
    for tp_size in (1, 2):
        engine = radixserve.Engine(str(tmp_path), dtype="float32", tp_size=tp_size,
                                   max_total_tokens=1024)
        try:
            texts[tp_size] = [out["text"] for out in engine.generate(["Hi"] * 3, params)]
        finally:
            engine.shutdown()
    assert texts[2] == texts[1]
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", texts[2][0])
    assert json.loads(texts[2][1])["id"] in (7, 42), texts[2][1]


@pytest.mark.slow  # 11 s; the identity check itself: test_rendezvous.py, in CI
def test_nodes_started_with_different_models_are_refused(tmp_path) -> None:
    """Node 1 given another checkpoint of the same shapes: both nodes fail at start-up with
    what differs, in one line (ranks of different weights would otherwise meet and serve
    garbage)."""
    import subprocess
    import sys

    from tests.server.server_process import REPO_ROOT, free_port

    make_checkpoint("llama_gqa_llama3_rope", tmp_path / "a")
    make_checkpoint("llama_gqa_llama3_rope", tmp_path / "b", seed=1)
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr",
              f"127.0.0.1:{free_port()}", "--dtype", "float32", "--skip-tokenizer-init",
              "--max-total-tokens", "1024", "--port", str(free_port())]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    nodes = [subprocess.Popen([sys.executable, "-m", "radixserve.launch_server", *common,
                               "--model-path", str(tmp_path / folder), "--node-rank", rank],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for folder, rank in (("b", "1"), ("a", "0"))]
    try:
        logs = [node.communicate(timeout=180)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, log in zip(nodes, logs):
        assert node.returncode == 1, log
        assert "node 1 was started unlike rank 0 (node 0): model '" in log, log
        assert "Traceback" not in log, log


@pytest.mark.slow
def test_speculative_decoding_at_tp2_equals_plain_tp1(tmp_path) -> None:
    """n-gram speculation at tp 2 over gloo: every rank drafts alike from the same tokens
    (each runs the scheduler), and the outputs are one plain rank's."""
    hf_model = make_checkpoint("llama_gqa_llama3_rope", tmp_path)
    prompts = _prompts(hf_model.config.vocab_size)
    prompts[1] = (prompts[1][:8] * 6)[:40]  # repeats itself: drafts are accepted
    spec = {"speculative_algorithm": "ngram", "speculative_ngram_min_match_window_size": 1}
    two = _run(str(tmp_path), 2, prompts, **spec)
    _assert_same_outputs(two, _run(str(tmp_path), 1, prompts))
    assert two["accept_len"] > 1.0


@pytest.mark.slow
def test_embeddings_at_tp2_equal_tp1(tmp_path) -> None:
    """--is-embedding at tp 2 over gloo: the final hidden states are whole on every rank after
    the all-reduces, so rank 0's vectors are one rank's."""
    from tests.models.test_embedding_models import save
    save("qwen3_headless", tmp_path)
    prompts = _prompts(160)
    vectors = {}
    for tp_size in (1, 2):
        engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                                   is_embedding=True, tp_size=tp_size, max_total_tokens=2048)
        try:
            vectors[tp_size] = [o["embedding"] for o in engine.encode(input_ids=prompts)]
        finally:
            engine.shutdown()
    torch.testing.assert_close(torch.tensor(vectors[2]), torch.tensor(vectors[1]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,at_run_time", [("llama_gqa_llama3_rope", False),
                                               ("gemma_mqa", True),
                                               pytest.param("deepseek_v2_lite_mla", False,
                                                            marks=pytest.mark.slow)])
def test_lora_adapters_at_tp2_match_the_merged_models(name: str, at_run_time: bool,
                                                      tmp_path) -> None:
    """LoRA at tp 2 over gloo: column-parallel layers hold B's rows of their rank (q|k|v by
    heads, the one KV head of an MQA model on both ranks; gate|up by pieces), row-parallel
    ones A's columns, their delta joining the partial product before the all-reduce; each
    request's greedy tokens are its merged model's. The MQA case loads its adapter while
    serving (Engine.load_lora_adapter: rank 0's load is mirrored to rank 1 with the turn);
    the MLA case adapts kv_b_proj too (each rank's heads of B)."""
    from tests.models.test_lora import ALL_MODULES, merged, write_adapter
    hf_model = make_checkpoint(name, tmp_path / "base")
    mla = ("kv_a_proj_with_mqa", "kv_b_proj") if name.startswith("deepseek") else ()
    pairs = write_adapter(tmp_path / "every", hf_model, ALL_MODULES + mla, rank=4, alpha=8.0,
                          seed=1, skip=".experts.")
    tuned = merged(hf_model, pairs, 2.0)
    prompts = _prompts(hf_model.config.vocab_size)
    names = ["every", None, "every"]
    slots = dict(max_loras=1, max_lora_rank=4, lora_target_modules=["all"]) if at_run_time \
        else dict(lora_paths=[f"every={tmp_path / 'every'}"])
    engine = radixserve.Engine(str(tmp_path / "base"), dtype="float32", tp_size=2,
                               skip_tokenizer_init=True, max_total_tokens=2048, **slots)
    try:
        if at_run_time:
            engine.load_lora_adapter("every", str(tmp_path / "every"))
        outs = engine.generate(input_ids=prompts, lora_path=names, sampling_params={
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    finally:
        engine.shutdown()
    for out, ids, name in zip(outs, prompts, names):
        assert out["output_ids"] == hf_greedy(tuned if name else hf_model, ids, 6)
