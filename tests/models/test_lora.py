"""LoRA adapters (--lora-paths) against transformers with each adapter merged into the weights
(W + scale B A, the definition of LoRA): one batch mixes requests of two adapters and of the
base model, and every request's greedy tokens equal its own merged model's (fp32).

RADIXSERVE_TEST_DEVICE=cuda runs the engines of the comparisons on a GPU (the references stay
on the CPU): adapter steps eager beside the base model's CUDA graph replays."""
from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import radixserve
from radixserve.core.request_validation import InvalidRequestError
from radixserve.loader.checkpoint_error import CheckpointError
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.tiny_checkpoints import make_checkpoint

CHECKPOINT = "llama_gqa_llama3_rope"  # GQA: q, k and v pieces of different sizes
DEVICE = os.environ.get("RADIXSERVE_TEST_DEVICE", "cpu")
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, hf_model, modules: tuple[str, ...], rank: int, alpha: float,
                  seed: int, rslora: bool = False, bin_file: bool = False,
                  extra_config: dict | None = None, skip: str | None = None
                  ) -> dict[str, tuple[torch.Tensor, ...]]:
    """A PEFT-style adapter folder for `hf_model` on the modules named `modules` (less those
    whose path contains `skip`); returns {module name: (A, B)}."""
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors, pairs = {}, {}
    for name, module in hf_model.named_modules():
        if name.rsplit(".", 1)[-1] not in modules or (skip is not None and skip in name):
            continue
        out_features, in_features = module.weight.shape
        a = torch.randn(rank, in_features, generator=gen) * 0.2
        b = torch.randn(out_features, rank, generator=gen) * 0.2
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
        pairs[name] = (a, b)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
              "target_modules": list(modules), "bias": "none", "fan_in_fan_out": False,
              **(extra_config or {})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if bin_file:
        torch.save(tensors, folder / "adapter_model.bin")
    else:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return pairs


def merged(hf_model, pairs, scale: float):
    model = copy.deepcopy(hf_model)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, (a, b) in pairs.items():
            modules[name].weight += scale * (b @ a)
    return model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf_model = make_checkpoint(CHECKPOINT, root / "base")
    every = write_adapter(root / "every", hf_model, ALL_MODULES, rank=4, alpha=8.0, seed=1)
    qv = write_adapter(root / "qv", hf_model, ("q_proj", "v_proj"), rank=2, alpha=4.0, seed=2,
                       rslora=True, bin_file=True)
    references = {"every": merged(hf_model, every, 8.0 / 4), "qv":
                  merged(hf_model, qv, 4.0 / math.sqrt(2)), None: hf_model}
    engine = radixserve.Engine(str(root / "base"), skip_tokenizer_init=True, dtype="float32",
                               device=DEVICE, max_total_tokens=2000,
                               lora_paths=[f"every={root / 'every'}", f"qv={root / 'qv'}"])
    yield engine, references, root
    engine.shutdown()


def test_a_batch_of_adapters_and_the_base_model_matches_each_merged_model(served) -> None:
    engine, references, _ = served
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (9, 17, 5, 9, 30)]
    names = ["every", "qv", None, None, "every"]
    prompts[3] = prompts[0]  # the same prompt with and without an adapter
    outs = engine.generate(input_ids=prompts, lora_path=names, sampling_params={
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    got = [out["output_ids"] for out in outs]
    want = [hf_greedy(references[name], ids, 6) for ids, name in zip(prompts, names)]
    assert got == want
    assert got[0] != got[3], "the adapter changes nothing: the test cannot tell"
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0


def test_an_unknown_adapter_is_refused_by_name(served) -> None:
    engine, _, _ = served
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'"):
        engine.generate(input_ids=[1, 2, 3], lora_path="nope")


@pytest.mark.parametrize("extra,message", [({"use_dora": True}, "DoRA"),
                                           ({"bias": "all"}, "trained biases"),
                                           ({"modules_to_save": ["lm_head"]}, "saved whole")])
def test_adapters_this_server_cannot_apply_fail_at_start(served, extra, message) -> None:
    _, references, root = served
    folder = root / f"refused_{message.split()[0]}"
    write_adapter(folder, references[None], ("q_proj",), rank=2, alpha=2.0, seed=3,
                  extra_config=extra)
    with pytest.raises(CheckpointError, match=message):
        radixserve.Engine(str(root / "base"), skip_tokenizer_init=True, dtype="float32",
                          device="cpu", max_total_tokens=500, lora_paths=[f"x={folder}"])


def test_an_adapter_of_a_module_that_is_not_a_linear_layer_fails_at_start(served) -> None:
    _, references, root = served
    folder = root / "norm"
    write_adapter(folder, references[None], ("q_proj",), rank=2, alpha=2.0, seed=4)
    tensors = {"base_model.model.model.norm.lora_A.weight": torch.zeros(2, 64),
               "base_model.model.model.norm.lora_B.weight": torch.zeros(64, 2)}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match="not a linear layer"):
        radixserve.Engine(str(root / "base"), skip_tokenizer_init=True, dtype="float32",
                          device="cpu", max_total_tokens=500, lora_paths=[f"x={folder}"])


def test_requests_share_cached_prefixes_with_their_own_adapter_only(served) -> None:
    """One prompt three times in turn: with an adapter (cached), without one (its own KV, not
    the adapter's), with the adapter again (a hit on the first request's KV)."""
    engine, references, _ = served
    prompt = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    outs = [engine.generate(input_ids=prompt, lora_path=name, sampling_params=greedy)
            for name in ("every", None, "every")]
    for out, name in zip(outs, ("every", None, "every")):
        assert out["output_ids"] == hf_greedy(references[name], prompt, 5)
    cached = [out["meta_info"]["cached_tokens"] for out in outs]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] >= len(prompt) - 1, cached


def test_decode_steps_through_the_per_row_kernels_match_each_merged_model(
        served, monkeypatch) -> None:
    """RADIXSERVE_LORA_ROWS_KERNEL=1 (the default on a GPU, the Triton interpreter here):
    decode steps mixing two adapters and the base model add each request's delta in the
    per-row kernels, and every request's greedy tokens are still its merged model's."""
    _, references, root = served
    monkeypatch.setenv("RADIXSERVE_LORA_ROWS_KERNEL", "1")
    engine = radixserve.Engine(str(root / "base"), skip_tokenizer_init=True, dtype="float32",
                               device=DEVICE, max_total_tokens=1000,
                               lora_paths=[f"every={root / 'every'}", f"qv={root / 'qv'}"])
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (7, 12, 9, 15)]
    names = ["qv", None, "every", "qv"]
    try:
        outs = engine.generate(input_ids=prompts, lora_path=names, sampling_params={
            "max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    finally:
        engine.shutdown()
    for out, ids, name in zip(outs, prompts, names):
        assert out["output_ids"] == hf_greedy(references[name], ids, 5)


def test_decode_graphs_take_each_requests_adapter_slot_in_a_sixth_input_row() -> None:
    """The graph runner's inputs: with adapters, a sixth row of slots (-1 for the base model
    and the padding rows) picks the graphs captured with the per-row kernels; a runner
    without them (RADIXSERVE_LORA_ROWS_KERNEL=0) leaves adapter steps to the eager path."""
    from types import SimpleNamespace

    from radixserve.core.forward_batch import ForwardMode, ModelWorkerBatch
    from radixserve.executor.cuda_graph_runner import (LORA_SLOTS, NUM_INPUT_ROWS,
                                                       CudaGraphRunner, fill_padded_inputs)
    batch = ModelWorkerBatch(ForwardMode.DECODE, [1, 2, 3], [0, 1, 2], [5, 6, 7],
                             torch.zeros(3, dtype=torch.int64),
                             lora_names=[None, "every", "qv"])
    staging = torch.full((NUM_INPUT_ROWS + 1, 4), 99, dtype=torch.int64)
    fill_padded_inputs(batch, 4, seq_len_fill=1, padding_row=9, out=staging,
                       lora_slots=[-1, 0, 1])
    assert staging[LORA_SLOTS].tolist() == [-1, 0, 1, -1]
    runner = SimpleNamespace(batch_sizes=[1, 2, 4], lora=None)
    assert not CudaGraphRunner.can_run(runner, batch)
    runner.lora = object()
    assert CudaGraphRunner.can_run(runner, batch)
    batch.lora_names = [None] * 3
    runner.lora = None
    assert CudaGraphRunner.can_run(runner, batch)


@pytest.mark.parametrize("module,checkpoint", [("gate", "deepseek_v2_lite_mla")])
def test_adapters_on_weights_the_model_reads_directly_fail_at_start(module, checkpoint,
                                                                    tmp_path) -> None:
    """DeepSeek's float32 router is read as a weight, not through its layer: an adapter
    there would be skipped, so it is refused."""
    hf_model = make_checkpoint(checkpoint, tmp_path / "base")
    write_adapter(tmp_path / "adapter", hf_model, (module,), rank=2, alpha=2.0, seed=5,
                  skip=".experts.")
    with pytest.raises(CheckpointError, match="reads directly"):
        radixserve.Engine(str(tmp_path / "base"), skip_tokenizer_init=True, dtype="float32",
                          device="cpu", max_total_tokens=500,
                          lora_paths=[f"x={tmp_path / 'adapter'}"])


@pytest.mark.parametrize("checkpoint", ["deepseek_v2_lite_mla", "deepseek_v2_q_lora"])
def test_mla_adapters_with_kv_b_proj_match_their_merged_models(checkpoint, tmp_path) -> None:
    """MLA with adapters on every attention projection, kv_b_proj included: its decode absorbs
    kv_b_proj per head (the adapter's low-rank terms added beside the absorbed weight) and its
    extends decompress cached prefixes and new tokens entry by entry with each request's
    adapter. A batch mixing the adapter and the base model, then the same prompts again
    (their prefixes from the cache), each equal to its merged model's greedy tokens."""
    hf_model = make_checkpoint(checkpoint, tmp_path / "base")
    modules = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    pairs = write_adapter(tmp_path / "adapter", hf_model, modules, rank=4, alpha=8.0, seed=16)
    references = {"x": merged(hf_model, pairs, 2.0), None: hf_model}
    engine = radixserve.Engine(str(tmp_path / "base"), skip_tokenizer_init=True,
                               dtype="float32", device=DEVICE, max_total_tokens=1000,
                               lora_paths=[f"x={tmp_path / 'adapter'}"])
    gen = torch.Generator().manual_seed(17)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (21, 13, 21)]
    names = ["x", None, None]
    prompts[2] = prompts[0]
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    try:
        first = engine.generate(input_ids=prompts, lora_path=names, sampling_params=greedy)
        again = engine.generate(input_ids=prompts[:2], lora_path=names[:2],
                                sampling_params=greedy)
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    for out, ids, name in zip(first + again, prompts + prompts[:2], names + names[:2]):
        assert out["output_ids"] == hf_greedy(references[name], ids, 6)
    assert first[0]["output_ids"] != first[2]["output_ids"], "the adapter changes nothing"
    assert again[0]["meta_info"]["cached_tokens"] > 0
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0


@pytest.mark.parametrize("checkpoint,modules,skip", [
    ("qwen3_qk_norm", ("q_proj", "k_proj", "v_proj", "o_proj"), None),
    ("gemma2_softcap_window", ALL_MODULES, None),
    ("qwen2_moe_shared", ALL_MODULES, ".experts."),  # attention and the shared expert
    ("qwen3_5_dense", ALL_MODULES, None),  # a hybrid: Gated DeltaNet layers between them
])
def test_other_families_match_their_merged_models(checkpoint, modules, skip, tmp_path) -> None:
    hf_model = make_checkpoint(checkpoint, tmp_path / "base")
    # Gemma-2's final soft cap saturates the logits of a model moved far from its own: a
    # gentler one
    alpha = 2.0 if checkpoint.startswith("gemma2") else 8.0
    pairs = write_adapter(tmp_path / "adapter", hf_model, modules, rank=4, alpha=alpha, seed=6,
                          skip=skip)
    tuned = merged(hf_model, pairs, alpha / 4)
    engine = radixserve.Engine(str(tmp_path / "base"), skip_tokenizer_init=True,
                               dtype="float32", device=DEVICE, max_total_tokens=1000,
                               lora_paths=[f"x={tmp_path / 'adapter'}"])
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (12, 33)]
    try:
        outs = engine.generate(input_ids=prompts, lora_path=["x", None], sampling_params={
            "max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    finally:
        engine.shutdown()
    if DEVICE == "cpu":
        expected = [hf_greedy(tuned, prompts[0], 5), hf_greedy(hf_model, prompts[1], 5)]
        base_first = hf_greedy(hf_model, prompts[0], 5)
    else:  # the same kernels on the merged and the base checkpoints: the device's own
        # summation orders (transformers on the CPU breaks the soft-capped ties of these tiny
        # random models another way)
        tuned.save_pretrained(tmp_path / "merged")
        expected = [_served(tmp_path / "merged", prompts[0]), _served(tmp_path / "base",
                                                                    prompts[1])]
        base_first = _served(tmp_path / "base", prompts[0])
    assert [out["output_ids"] for out in outs] == expected
    assert outs[0]["output_ids"] != base_first, "the adapter is inert"


def _served(folder, prompt: list[int]) -> list[int]:
    """Greedy tokens of a checkpoint served without adapters on DEVICE."""
    engine = radixserve.Engine(str(folder), skip_tokenizer_init=True, dtype="float32",
                               device=DEVICE, max_total_tokens=1000)
    try:
        return engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 5, "temperature": 0, "ignore_eos": True})["output_ids"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order", "fp8_block"])
def test_adapters_on_quantised_bases_match_the_merged_dequantised_model(fmt, tmp_path,
                                                                         monkeypatch) -> None:
    """QLoRA-style serving: an int4 (AWQ; GPTQ act-order, whose layers permute their inputs;
    kept packed as on a GPU) or FP8 base checkpoint with a LoRA adapter in the compute dtype
    gives the greedy tokens of its dequantised twin with the adapter merged."""
    from transformers import AutoModelForCausalLM

    from radixserve.layers.quantization import int4_linear
    monkeypatch.setattr(int4_linear, "PACKED_ON_CPU", True)
    if fmt == "fp8_block":
        from tests.loader.test_fp8_checkpoints import _write_pair
        folder, twin_path = _write_pair(tmp_path, "block")
    else:
        from tests.models.int4_checkpoints import write_int4_pair
        folder, twin_path = write_int4_pair(tmp_path, fmt.split("_")[0],
                                            act_order=fmt.endswith("act_order"))
    twin = AutoModelForCausalLM.from_pretrained(twin_path, dtype=torch.float32).eval()
    pairs = write_adapter(tmp_path / "adapter", twin, ALL_MODULES, rank=4, alpha=8.0, seed=2)
    engine = radixserve.Engine(str(folder), skip_tokenizer_init=True, dtype="float32",
                               device=DEVICE, max_total_tokens=1000,
                               lora_paths=[f"x={tmp_path / 'adapter'}"])
    prompt = torch.randint(0, 160, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    try:
        out = engine.generate(input_ids=[prompt, prompt], lora_path=["x", None],
                              sampling_params={"max_new_tokens": 5, "temperature": 0,
                                               "ignore_eos": True})
    finally:
        engine.shutdown()
    assert out[0]["output_ids"] == hf_greedy(merged(twin, pairs, 2.0), prompt, 5)
    assert out[1]["output_ids"] == hf_greedy(twin, prompt, 5)


def test_cache_keys_move_an_adapters_tokens_and_follow_a_replaced_last_token() -> None:
    """Req.cache_key: the base model's keys are its tokens; an adapter's are moved past every
    token id (its prompt's part kept, its outputs' moved afresh: jump-forward may replace the
    last output token)."""
    from radixserve.core.req import Req, lora_key_offset
    from radixserve.core.sampling_params import SamplingParams
    base = Req("b", [1, 2, 3], SamplingParams())
    ids = [1, 2, 3]
    assert base.cache_key(ids) is ids
    req, other = (Req(rid, [1, 2, 3], SamplingParams(), lora_name=name)
                  for rid, name in (("a", "every"), ("q", "qv")))
    offset = lora_key_offset("every")
    assert offset >= 2 ** 32 and lora_key_offset("qv") not in (0, offset)
    assert other.cache_key([1, 2]) != req.cache_key([1, 2]) != [1, 2]
    req.output_ids = [7, 8]
    assert req.cache_key(req.all_ids()) == [t + offset for t in (1, 2, 3, 7, 8)]
    req.output_ids[-1] = 9  # replaced, as jump-forward does
    assert req.cache_key(req.all_ids()) == [t + offset for t in (1, 2, 3, 7, 9)]
    assert req.cache_key([1, 2]) == [1 + offset, 2 + offset]


def test_chunked_and_mixed_passes_keep_each_requests_adapter(served) -> None:
    """Prompts split into 16-token chunks and decode steps riding in the chunks' passes
    (--enable-mixed-chunk), over a small KV cache: every request's greedy tokens are still its
    merged model's."""
    _, references, root = served
    engine = radixserve.Engine(str(root / "base"), skip_tokenizer_init=True, dtype="float32",
                               device=DEVICE, max_total_tokens=160, chunked_prefill_size=16,
                               enable_mixed_chunk=True,
                               lora_paths=[f"every={root / 'every'}", f"qv={root / 'qv'}"])
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist()
               for n in (20, 9, 23, 11, 14, 17, 8, 12)]
    names = ["qv", "every", None, "every", "qv", None, "every", "qv"]
    try:
        outs = engine.generate(input_ids=prompts, lora_path=names, sampling_params={
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    for out, ids, name in zip(outs, prompts, names):
        assert out["output_ids"] == hf_greedy(references[name], ids, 24)
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0


def test_adapters_load_into_free_slots_and_unload_while_serving(served, tmp_path) -> None:
    """Engine.load_lora_adapter / unload_lora_adapter with slots made at start (--max-loras 1,
    --max-lora-rank 4, q and v only): an adapter the slots cannot take is refused with the
    reason, a loaded one serves its merged model's tokens, an unloaded one is refused, and one
    loaded later under the same name gets none of the old one's cached KV."""
    _, references, root = served
    hf_model = references[None]
    engine = radixserve.Engine(str(root / "base"), skip_tokenizer_init=True, dtype="float32",
                               device=DEVICE, max_total_tokens=1000, max_loras=1,
                               max_lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    prompt = torch.randint(0, 160, (30,), generator=torch.Generator().manual_seed(31)).tolist()
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    write_adapter(tmp_path / "rank8", hf_model, ("q_proj",), rank=8, alpha=8.0, seed=12)
    later = write_adapter(tmp_path / "later", hf_model, ("q_proj", "v_proj"), rank=4,
                          alpha=8.0, seed=13)
    for folder, config, weights in (("truncated", {"r": 4}, b"\x10" + b"\x00" * 7 + b"{"),
                                    ("listed", [], None)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "adapter_config.json").write_text(json.dumps(config))
        if weights is not None:
            (tmp_path / folder / "adapter_model.safetensors").write_bytes(weights)
    try:
        for path, reason in ((root / "every", "not among the LoRA target modules"),
                             (tmp_path / "rank8", "above --max-lora-rank 4"),
                             (tmp_path / "missing", "no adapter_config.json"),
                             (tmp_path / "truncated", "cannot read"),
                             (tmp_path / "listed", "not a JSON object")):
            with pytest.raises(ValueError, match=reason):
                engine.load_lora_adapter("x", str(path))
        engine.load_lora_adapter("x", str(root / "qv"))
        with pytest.raises(ValueError, match="slots are taken"):
            engine.load_lora_adapter("y", str(root / "qv"))
        first = engine.generate(input_ids=prompt, lora_path="x", sampling_params=greedy)
        assert first["output_ids"] == hf_greedy(references["qv"], prompt, 5)
        engine.unload_lora_adapter("x")
        with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'x'"):
            engine.generate(input_ids=prompt, lora_path="x", sampling_params=greedy)
        engine.load_lora_adapter("x", str(tmp_path / "later"))
        again = engine.generate(input_ids=prompt, lora_path="x", sampling_params=greedy)
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    assert again["output_ids"] == hf_greedy(merged(hf_model, later, 2.0), prompt, 5)
    assert again["output_ids"] != first["output_ids"], "the two adapters agree: no test"
    assert again["meta_info"]["cached_tokens"] == 0  # the old adapter's KV is not its own
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0


def test_lora_slots_without_adapters_need_a_rank() -> None:
    from radixserve.config import ServerArgs
    with pytest.raises(ValueError, match="--max-lora-rank"):
        ServerArgs(device="cpu", max_loras=2).resolve()
    with pytest.raises(ValueError, match="fewer than the 2 adapters"):
        ServerArgs(device="cpu", max_loras=1, lora_paths=["a=x", "b=y"]).resolve()


def test_a_hybrid_models_adapter_requests_share_cached_prefixes_with_their_own_only(
        tmp_path) -> None:
    """Qwen3.5 (Gated DeltaNet layers, whose states the cache keeps at snapshots): one prompt
    with an adapter, without, with again; each output is its merged model's and only the
    third reuses a cached prefix (the snapshot the first one's pass kept)."""
    hf_model = make_checkpoint("qwen3_5_dense", tmp_path / "base")
    pairs = write_adapter(tmp_path / "adapter", hf_model, ("q_proj", "v_proj", "down_proj"),
                          rank=4, alpha=8.0, seed=14)
    references = {"x": merged(hf_model, pairs, 2.0), None: hf_model}
    engine = radixserve.Engine(str(tmp_path / "base"), skip_tokenizer_init=True,
                               dtype="float32", device=DEVICE, max_total_tokens=1000,
                               lora_paths=[f"x={tmp_path / 'adapter'}"])
    prompt = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(15)).tolist()
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    try:
        outs = [engine.generate(input_ids=prompt, lora_path=name, sampling_params=greedy)
                for name in ("x", None, "x")]
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    for out, name in zip(outs, ("x", None, "x")):
        assert out["output_ids"] == hf_greedy(references[name], prompt, 5)
    cached = [out["meta_info"]["cached_tokens"] for out in outs]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] > 0, cached
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
