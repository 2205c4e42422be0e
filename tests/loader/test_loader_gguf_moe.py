"""Mixture-of-experts GGUF files, written the way llama.cpp's converter writes them: each layer's
experts stacked into one [experts, rows, cols] tensor per projection, the router kept F32, the
rest F32, F16, BF16, Q8_0 or Q5_0. Mixtral is llama.cpp's "llama" with experts (q/k rows
permuted), Qwen2-MoE has a shared expert with a sigmoid gate, Qwen3-MoE per-head q/k norms. Read
back against the HF checkpoint the file was made from (rounded as the file's type rounds it),
transformers' own GGUF import (Qwen2-MoE and Qwen3-MoE: transformers reads a "llama" file as a
dense Llama), and the HF model's greedy tokens vs radixserve.Engine on F32 and Q8_0 files."""
from __future__ import annotations

import copy
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFWriter, get_tensor_name_map
from gguf.constants import MODEL_ARCH_NAMES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

import radixserve
from radixserve.core.model_config import ModelConfig, hf_config_from_dict
from radixserve.loader.gguf_file import read_gguf
from radixserve.loader.gguf_loader import gguf_to_hf_config, iter_gguf_file_weights
from radixserve.models.moe_blocks import routing_config
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.tiny_checkpoints import CONFIGS, make_checkpoint

from loader_test_utils import llama_cpp_permute, write_gguf_tensors

F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0
# each dequantisation path of an expert slab: F32 view, BF16 widening, the torch block formats,
# gguf-py's (F16, Q5_0)
WEIGHT_TYPES = [F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, Q8_0,
                GGMLQuantizationType.Q5_0]
# case -> (GGUF architecture, tiny checkpoint, config changes)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("llama", "mixtral_moe", {}),
    # llama.cpp's qwen2moe has no dense layers (nor gguf's tensor map dense names for it); a
    # shared expert of 64 (not 48) so Q8_0's 32-column blocks tile its down projection's rows
    "qwen2moe": ("qwen2moe", "qwen2_moe_shared",
                 {"mlp_only_layers": [], "shared_expert_intermediate_size": 64}),
    "qwen3moe": ("qwen3moe", "qwen3_moe", {"head_dim": 24}),  # not hidden / heads = 16
}
NAMES = sorted(CASES)
COMMON_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
               "rope_parameters", "tie_word_embeddings", "num_experts_per_tok")
QWEN_MOE_KEYS = ("num_experts", "moe_intermediate_size", "norm_topk_prob",
                 "decoder_sparse_step", "mlp_only_layers")
MOE_KEYS = {"mixtral": ("intermediate_size", "num_local_experts"),
            "qwen2moe": QWEN_MOE_KEYS + ("shared_expert_intermediate_size",),
            "qwen3moe": QWEN_MOE_KEYS + ("head_dim",)}
# kept F32 by the converter: routers (and Qwen2-MoE's shared-expert gate, 1-D in the file)
ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")
EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
LEGACY_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w\d)\.weight$")
LEGACY_PIECES = {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}


def _checkpoint(case: str, folder: Path, monkeypatch: pytest.MonkeyPatch,
                **overrides: Any) -> transformers.PreTrainedModel:
    _, name, changes = CASES[case]
    config_cls, kwargs = CONFIGS[name]
    monkeypatch.setitem(CONFIGS, f"{name}_gguf", (config_cls, {**kwargs, **changes, **overrides}))
    return make_checkpoint(f"{name}_gguf", folder)


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint as saved: one tensor per expert and projection, as llama.cpp reads it."""
    return load_file(folder / "model.safetensors")


def _stack_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The converter's first step: `experts.{e}.{piece}.weight` stacked over e into
    `experts.{piece}.weight` [experts, rows, cols]."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for name, tensor in state_dict.items():
        found = EXPERT_NAME.match(name)
        if found is None:
            out[name] = tensor
        else:
            stacks[f"{found[1]}.{found[3]}.weight"][int(found[2])] = tensor
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def _quantised(name: str, ndim: int) -> bool:
    return ndim >= 2 and not name.endswith(ROUTERS)


def _llama_cpp_tensors(arch: str, state_dict: dict[str, torch.Tensor], config: dict[str, Any],
                       stacked: bool = True) -> Iterator[tuple[str, str, np.ndarray]]:
    """(llama.cpp name, HF name, array): experts stacked, named by gguf's own map, Llama q/k rows
    permuted, the shared-expert gate squeezed to [hidden] as llama.cpp declares it. Not
    stacked: Mixtral's experts one tensor each, as files converted before December 2023 hold
    them (blk.N.ffn_gate.E.weight)."""
    model_arch = {name: key for key, name in MODEL_ARCH_NAMES.items()}[arch]
    name_map = get_tensor_name_map(model_arch, config["num_hidden_layers"])
    for hf_name, tensor in (_stack_experts(state_dict) if stacked else state_dict).items():
        legacy = None if stacked else LEGACY_EXPERT.match(hf_name)
        if legacy is not None:
            layer, expert, piece = legacy.groups()
            name = f"blk.{layer}.{LEGACY_PIECES[piece]}.{expert}.weight"
            yield name, hf_name, tensor.float().numpy()
            continue
        array = tensor.float().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config["num_attention_heads"])
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config["num_key_value_heads"])
        elif hf_name.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)
        yield name_map.get_name(hf_name, try_suffixes=(".weight", ".bias")), hf_name, array


def _write(case: str, model: transformers.PreTrainedModel, folder: Path, path: Path,
           quant: GGMLQuantizationType = F32, stacked: bool = True) -> str:
    """The checkpoint in `folder` as a GGUF at `path`, with the MoE keys the converter writes."""
    arch = CASES[case][0]
    config = model.config.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)

    def add_moe_keys(writer: GGUFWriter) -> None:
        writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if arch != "llama":
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(
                config["shared_expert_intermediate_size"])

    tensors = ((name, array, _quantised(hf_name, array.ndim)) for name, hf_name, array
               in _llama_cpp_tensors(arch, _saved(folder), config, stacked))
    write_gguf_tensors(arch, config, path, tensors, quant, add_moe_keys)
    return str(path)


def _rounded(state_dict: dict[str, torch.Tensor], quant: GGMLQuantizationType
             ) -> dict[str, torch.Tensor]:
    """The tensors as a `quant` file holds them: quantisation rounds each row on its own, so
    this is exact for stacked, fused or permuted rows alike."""
    if quant == F32:
        return dict(state_dict)
    return {name: torch.from_numpy(dequantize(quantize(t.float().numpy(), quant), quant))
            if _quantised(name, t.dim()) else t for name, t in state_dict.items()}


def _f32(value: Any) -> Any:
    return np.float32(value) if isinstance(value, float) else value


def _as_fused_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors in transformers 5's layout: `experts.gate_up_proj` [E, 2I, H] (gate
    rows, then up rows) and `experts.down_proj` [E, H, I]."""
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)
    for name, tensor in weights.items():
        found = EXPERT_NAME.match(name)
        if found is None:
            out[name] = tensor
        else:
            pieces[found[1]][int(found[2]), found[3]] = tensor
    for prefix, by_expert in pieces.items():
        experts = range(len(by_expert) // 3)
        stack = {p: torch.stack([by_expert[e, p] for e in experts])
                 for p in ("gate_proj", "up_proj", "down_proj")}
        out[f"{prefix}.gate_up_proj"] = torch.cat((stack["gate_proj"], stack["up_proj"]), 1)
        out[f"{prefix}.down_proj"] = stack["down_proj"]
    return out


@pytest.mark.parametrize("case", NAMES)
def test_config_matches_hf_checkpoint(case: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = _checkpoint(case, tmp_path / "hf", monkeypatch)
    path = _write(case, model, tmp_path / "hf", tmp_path / "gguf" / "f32.gguf")
    ours, theirs = hf_config_from_dict(gguf_to_hf_config(read_gguf(path))), model.config
    for key in COMMON_KEYS + MOE_KEYS[case]:
        assert getattr(ours, key) == getattr(theirs, key), key
    ours_mc, theirs_mc = ModelConfig(ours), ModelConfig(theirs)
    for key in ("architecture", "head_dim", "intermediate_size", "attention_bias",
                "o_proj_bias", "sliding_window", "rope_type"):
        assert getattr(ours_mc, key) == getattr(theirs_mc, key), key
    assert routing_config(ours_mc) == routing_config(theirs_mc)


@pytest.mark.parametrize("quant", WEIGHT_TYPES, ids=lambda t: t.name.lower())
@pytest.mark.parametrize("case", NAMES)
def test_weights_are_the_hf_checkpoint_per_expert(case: str, quant: GGMLQuantizationType,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stacked tensor comes back as the checkpoint's per-expert tensors, in HF layout
    (Mixtral's q/k un-permuted), exactly: the F32 values, or the file type's rounding of
    them."""
    model = _checkpoint(case, tmp_path / "hf", monkeypatch)
    path = _write(case, model, tmp_path / "hf", tmp_path / "gguf" / "model.gguf", quant)
    assert read_gguf(path).tensors["blk.1.ffn_down_exps.weight"].ggml_type == quant
    expected = _rounded(_saved(tmp_path / "hf"), quant)
    loaded = dict(iter_gguf_file_weights(path))
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == torch.float32, name
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("quant", [F32, Q8_0], ids=["f32", "q8_0"])
def test_mixtral_files_with_one_tensor_per_expert_load(quant: GGMLQuantizationType,
                                                      tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixtral GGUFs converted before llama.cpp stacked the experts (blk.N.ffn_gate.E.weight,
    2-D) load as the stacked files do: the checkpoint's per-expert tensors, exactly."""
    model = _checkpoint("mixtral", tmp_path / "hf", monkeypatch)
    path = _write("mixtral", model, tmp_path / "hf", tmp_path / "gguf" / "legacy.gguf", quant,
                  stacked=False)
    tensors = read_gguf(path).tensors
    assert "blk.1.ffn_down.3.weight" in tensors and "blk.1.ffn_down_exps.weight" not in tensors
    expected = _rounded(_saved(tmp_path / "hf"), quant)
    loaded = dict(iter_gguf_file_weights(path))
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    config = hf_config_from_dict(gguf_to_hf_config(read_gguf(path)))
    assert config.architectures == ["MixtralForCausalLM"]


@pytest.mark.parametrize("quant", [F32, Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("case", ["qwen2moe", "qwen3moe"])
def test_transformers_gguf_import_agrees(case: str, quant: GGMLQuantizationType, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' GGUF import of the same file gives the same tensors and config. It reads
    neither expert_feed_forward_length nor expert_shared_feed_forward_length (its config
    class's defaults stay), so the experts here have those default sizes."""
    pytest.importorskip("accelerate")  # transformers loads GGUF files only with it installed
    config_cls = CONFIGS[CASES[case][1]][0]
    sizes = ("moe_intermediate_size", "shared_expert_intermediate_size")
    defaults = {key: getattr(config_cls(), key) for key in sizes if hasattr(config_cls(), key)}
    model = _checkpoint(case, tmp_path / "hf", monkeypatch, **defaults)
    path = Path(_write(case, model, tmp_path / "hf", tmp_path / "gguf" / "model.gguf", quant))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    theirs = reference.state_dict()
    ours = _as_fused_experts(dict(iter_gguf_file_weights(str(path))))
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)
    cfg = hf_config_from_dict(gguf_to_hf_config(read_gguf(str(path))))
    for key in COMMON_KEYS[1:] + MOE_KEYS[case]:  # transformers keeps float32 metadata widened
        assert _f32(getattr(cfg, key)) == _f32(getattr(reference.config, key)), key


def _engine_greedy(path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    engine = radixserve.Engine(path, dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=2048, chunked_prefill_size=32)
    try:
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        return [r["output_ids"] for r in engine.generate(input_ids=prompts,
                                                         sampling_params=params)]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("quant", [F32, Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("case", NAMES)
def test_engine_on_gguf_gives_hf_greedy_tokens(case: str, quant: GGMLQuantizationType,
                                               tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The Engine on the file against the HF model with the file's values (Q8_0: the model's
    weights rounded as the file rounds them)."""
    model = _checkpoint(case, tmp_path / "hf", monkeypatch)
    path = _write(case, model, tmp_path / "hf", tmp_path / "gguf" / "model.gguf", quant)
    twin = copy.deepcopy(model)
    twin.load_state_dict(_rounded(model.state_dict(), quant))
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (45, 70)]
    new_tokens = 16
    expected = [hf_greedy(twin, ids, new_tokens) for ids in prompts]
    assert _engine_greedy(path, prompts, new_tokens) == expected


def test_config_without_optional_moe_keys_takes_llama_cpp_defaults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _checkpoint("qwen2moe", tmp_path / "hf", monkeypatch)
    gguf_file = read_gguf(_write("qwen2moe", model, tmp_path / "hf", tmp_path / "m.gguf"))
    for key in ("expert_feed_forward_length", "expert_shared_feed_forward_length"):
        del gguf_file.metadata[f"qwen2moe.{key}"]
    cfg = gguf_to_hf_config(gguf_file)
    # llama.cpp: feed_forward_length / experts used, and feed_forward_length
    assert (cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]) == (48, 96)
    assert cfg["norm_topk_prob"] is False and cfg["model_type"] == "qwen2_moe"
