"""Int4 (W4A16) checkpoints in each supported layout load and give the logits of their
dequantised twin (float32 on the CPU: the two must agree to float error): AWQ, GPTQ (symmetric,
with zero points, act-order) and compressed-tensors pack-quantized (symmetric, zero points,
group act-order); the packed form (codes in int32 words, the act-order permutation) through the
reference product as well as the CPU's dequantised layers; layers the checkpoint leaves
unquantised; and the checkpoints radixserve refuses, with their reasons."""
from __future__ import annotations

import json

import pytest
import torch

import radixserve
from radixserve.layers.quantization import int4_linear
from radixserve.layers.quantization.int4 import (AWQ_ORDER, int4_config, pack_int32,
                                                 unpack_int32)
from tests.loader.test_fp8_checkpoints import _logits
from tests.models.int4_checkpoints import awq_tensors, write_int4_pair


def _assert_twins(folder, twin, **kwargs) -> None:
    for got, want in zip(_logits(folder, **kwargs), _logits(twin)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method,symmetric,act_order,model", [
    ("awq", False, False, "llama_gqa_llama3_rope"),
    ("awq", False, False, "qwen2_bias"),
    ("gptq", True, False, "llama_gqa_llama3_rope"),
    ("gptq", False, False, "llama_gqa_llama3_rope"),
    ("gptq", True, True, "llama_gqa_llama3_rope"),
    ("compressed-tensors", True, False, "llama_gqa_llama3_rope"),
    ("compressed-tensors", False, False, "qwen3_qk_norm"),
    ("compressed-tensors", True, True, "llama_gqa_llama3_rope")])
def test_int4_checkpoint_matches_its_dequantised_twin(method, symmetric, act_order, model,
                                                      tmp_path) -> None:
    folder, twin = write_int4_pair(tmp_path, method, model, symmetric=symmetric,
                                   act_order=act_order)
    _assert_twins(folder, twin)


@pytest.mark.parametrize("method,symmetric,act_order", [
    ("awq", False, False), ("gptq", True, True), ("compressed-tensors", False, True)])
def test_the_packed_form_matches_its_twin(method, symmetric, act_order, tmp_path,
                                          monkeypatch) -> None:
    """RADIXSERVE_INT4_CPU=packed: the GPU's form (int32 words, zero points kept only where not
    8, the act-order permutation of the activations) through the reference product."""
    monkeypatch.setattr(int4_linear, "PACKED_ON_CPU", True)
    folder, twin = write_int4_pair(tmp_path, method, symmetric=symmetric, act_order=act_order)
    _assert_twins(folder, twin)


def test_packed_layers_hold_int32_words_and_the_permutation(tmp_path, monkeypatch) -> None:
    from radixserve.config import ServerArgs
    from radixserve.executor.model_runner import ModelRunner
    monkeypatch.setattr(int4_linear, "PACKED_ON_CPU", True)
    folder, _ = write_int4_pair(tmp_path, "gptq", symmetric=True, act_order=True)
    runner = ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu",
                                    max_total_tokens=256, max_running_requests=2))
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.int4_qweight.dtype == torch.int32 and qkv.int4_qweight.shape == (128, 8)
    assert qkv.int4_zeros is None  # symmetric: every zero point is 8
    assert qkv.int4_perm is not None and sorted(qkv.int4_perm.tolist()) == list(range(64))
    assert not hasattr(qkv, "weight") and qkv.bias is None  # GPTQ's zero biases dropped


def test_layers_left_unquantised_load_as_they_are(tmp_path) -> None:
    folder, twin = write_int4_pair(tmp_path, "awq", skipped=("layers.1.mlp",))
    _assert_twins(folder, twin)
    folder, twin = write_int4_pair(tmp_path / "ct", "compressed-tensors", symmetric=True,
                                   skipped=("model.layers.0.self_attn.o_proj",))
    _assert_twins(folder, twin)


def _greedy(path, device: str) -> list[list[int]]:
    engine = radixserve.Engine(str(path), skip_tokenizer_init=True, dtype="float32",
                               device=device, max_total_tokens=1000)
    try:
        got = engine.generate(input_ids=[[5, 9, 13, 2, 7] * 3, [11, 3, 8]], sampling_params={
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        state = engine.get_internal_state()
        assert state["memory_check_ok"] and state["leaked_tokens"] == 0
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in got]


def test_the_engine_greedy_output_equals_the_twins(tmp_path) -> None:
    folder, twin = write_int4_pair(tmp_path, "awq")
    assert _greedy(folder, "cpu") == _greedy(twin, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the int4 kernels on a GPU")
@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", True),
                                              ("compressed-tensors", False)])
def test_on_the_gpu_the_kernels_keep_the_twins_greedy_output(method, act_order,
                                                             tmp_path) -> None:
    """The Triton W4A16 kernels (decode rows in CUDA graphs, prefill rows) in float32."""
    folder, twin = write_int4_pair(tmp_path, method, symmetric=method != "awq",
                                   act_order=act_order)
    assert _greedy(folder, "cuda") == _greedy(twin, "cuda") == _greedy(twin, "cpu")


def test_unpacking_follows_each_format() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 24), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_int32(pack_int32(codes)), codes)
    # AWQ's word: output feature 8c + AWQ_ORDER[i] in nibble i
    packed = awq_tensors(codes, torch.ones(16, 1), torch.zeros(16, 1, dtype=torch.uint8))
    word = int(packed["qweight"][3, 1]) & 0xFFFFFFFF
    for i, column in enumerate(AWQ_ORDER):
        assert (word >> (4 * i)) & 0xF == int(codes[8 + column, 3])
    assert torch.equal(unpack_int32(packed["qweight"], AWQ_ORDER).t(), codes)


def test_awq_unpacking_agrees_with_compressed_tensors_converter() -> None:
    """compressed-tensors' AutoAWQ converter reads the same codes and zero points."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from radixserve.layers.quantization.int4 import codes_to_rows, zeros_to_rows
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (32, 2), generator=gen, dtype=torch.uint8)
    packed = awq_tensors(codes, torch.rand(32, 2), zeros)
    weight, _, zero_point = AutoAWQConverter(group_size=32)._convert_gemm_module(
        packed["qweight"], packed["scales"], packed["qzeros"])
    config = int4_config({"quant_method": "awq", "bits": 4, "group_size": 32}, None)
    assert torch.equal(codes_to_rows(config, packed["qweight"]).to(torch.int16) - 8,
                       weight.to(torch.int16))
    assert torch.equal(zeros_to_rows(config, packed["qzeros"], 32).to(torch.int16) - 8,
                       zero_point.to(torch.int16))


def test_the_quantization_flag_names_the_checkpoints_method(tmp_path) -> None:
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    assert int4_config(qc, "gptq_marlin").method == "gptq"
    with pytest.raises(ValueError, match="does not match the checkpoint's gptq"):
        int4_config(qc, "awq")
    with pytest.raises(ValueError, match="needs a checkpoint quantised that way"):
        int4_config(None, "awq")
    assert int4_config(None, "awq", dummy=True).group_size == 128
    with pytest.raises(ValueError, match="4-bit only"):
        int4_config({**qc, "bits": 8}, None)
    with pytest.raises(ValueError, match="version 'gemv'"):
        int4_config({"quant_method": "awq", "bits": 4, "version": "gemv"}, None)
    with pytest.raises(ValueError, match="per-module overrides"):
        int4_config({**qc, "dynamic": {"-:.*down_proj": {}}}, None)
    from radixserve.layers.quantization.fp8 import fp8_config
    with pytest.raises(ValueError, match="cannot requantise an int4 checkpoint"):
        fp8_config(qc, "fp8")
    assert fp8_config(qc, None) is None
    # compressed-tensors names an FP8 checkpoint's method too
    from tests.loader.test_fp8_checkpoints import _quant_config
    assert int4_config(_quant_config("channel"), "compressed-tensors") is None
    assert fp8_config(_quant_config("channel"), "compressed-tensors").block is None
    # older llm-compressor spellings of group act-order
    from tests.models.int4_checkpoints import quant_config
    for spelling in ("dynamic", True):
        ct = quant_config("compressed-tensors", 32, True, True)
        ct["config_groups"]["group_0"]["weights"]["actorder"] = spelling
        assert int4_config(ct, None).act_order


@pytest.mark.parametrize("method,symmetric,model", [
    ("awq", False, "mixtral_moe"), ("gptq", True, "qwen3_moe"),
    ("compressed-tensors", False, "qwen2_moe_shared")])
@pytest.mark.parametrize("form", ["dense", "packed"])
def test_int4_experts_match_their_dequantised_twin(method, symmetric, model, form, tmp_path,
                                                   monkeypatch) -> None:
    """Routed experts (and Qwen2-MoE's shared expert) from int4 checkpoints; "packed": the
    GPU's stacks through the reference expert loop."""
    monkeypatch.setattr(int4_linear, "PACKED_ON_CPU", form == "packed")
    folder, twin = write_int4_pair(tmp_path, method, model, group=16, symmetric=symmetric)
    _assert_twins(folder, twin)


def test_experts_left_unquantised_load_as_they_are(tmp_path) -> None:
    """AWQ's modules_to_not_convert naming a layer's whole MoE block: plain expert stacks."""
    folder, twin = write_int4_pair(tmp_path, "awq", "qwen3_moe", group=16,
                                   skipped=("layers.1.mlp",))
    _assert_twins(folder, twin)


def test_int4_experts_stored_in_one_tensor_are_refused_by_name() -> None:
    from radixserve.layers.moe.experts import FusedMoE
    from radixserve.layers.quantization.int4 import int4_linears
    with int4_linears(int4_config({"quant_method": "awq", "bits": 4, "group_size": 16}, None)):
        moe = FusedMoE(2, 32, 32)
    with pytest.raises(ValueError, match="stored all in one tensor are not supported"):
        moe.w13_weight.weight_loader(moe.w13_weight, torch.zeros(2, 64, 32), ("all", "w13"))


def test_int4_checkpoints_the_kernels_cannot_serve_are_refused(tmp_path) -> None:
    folder, _ = write_int4_pair(tmp_path, "gptq", "qwen3_moe", group=16, symmetric=True,
                                act_order=True)
    with pytest.raises(ValueError, match="act-order .* experts are not supported"):
        _logits(folder)
    from radixserve.config import ServerArgs
    from radixserve.executor.model_runner import ModelRunner
    from tests.models.tiny_checkpoints import make_checkpoint
    make_checkpoint("qwen3_5_dense", tmp_path / "hybrid")
    config = json.loads((tmp_path / "hybrid" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 8}
    (tmp_path / "hybrid" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hybrid recurrent models are not supported yet"):
        ModelRunner(ServerArgs(model_path=str(tmp_path / "hybrid"), dtype="float32",
                               device="cpu", max_total_tokens=256, max_running_requests=2))
    make_checkpoint("gpt_oss_sinks_window", tmp_path / "gpt_oss")
    config = json.loads((tmp_path / "gpt_oss" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 16}
    (tmp_path / "gpt_oss" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"experts \(StackedExperts\) are not supported yet"):
        ModelRunner(ServerArgs(model_path=str(tmp_path / "gpt_oss"), dtype="float32",
                               device="cpu", max_total_tokens=256, max_running_requests=2))
