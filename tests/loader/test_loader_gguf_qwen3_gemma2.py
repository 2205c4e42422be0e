"""Qwen3 and Gemma-2 GGUF files, written the way llama.cpp's converter writes them (F32 and
Q8_0), read back against transformers: the HF checkpoint the file was made from, transformers' own
GGUF import of the same file, and the HF model's greedy tokens vs radixserve.Engine on the file."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gguf.constants import GGMLQuantizationType

import radixserve
from radixserve.core.model_config import ModelConfig, hf_config_from_dict
from radixserve.loader.gguf_file import read_gguf
from radixserve.loader.gguf_loader import gguf_to_hf_config, iter_gguf_file_weights
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.tiny_checkpoints import CONFIGS, make_checkpoint

from loader_test_utils import write_gguf

F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0
# GGUF architecture -> (tiny checkpoint, config changes a llama.cpp file needs)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3_qk_norm", {}),  # head_dim 24, not hidden / heads = 16
    # no GGUF key holds query_pre_attn_scalar: llama.cpp uses head_dim (but for the 27B)
    "gemma2": ("gemma2_softcap_window", {"query_pre_attn_scalar": 16}),
}
ARCHS = sorted(CASES)
# the config fields the two sides must agree on (transformers' GGUF import sets no architectures)
COMMON_KEYS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
               "max_position_embeddings", "rms_norm_eps", "rope_parameters",
               "tie_word_embeddings", "attention_bias")
GEMMA2_KEYS = ("hidden_activation", "attn_logit_softcapping", "final_logit_softcapping",
               "sliding_window", "layer_types", "query_pre_attn_scalar")
# GEMMA2_KEYS that transformers' GGUF import reads (it leaves the others at Gemma2Config defaults)
TRANSFORMERS_GEMMA2_KEYS = ("sliding_window",)
# 1 ulp of float32 at Gemma's stored norms w + 1 (in [1.8, 2.2]): what (w + 1) - 1 may lose
GEMMA_NORM_ULP = 2.0 ** -22


def _checkpoint(arch: str, folder: Path, monkeypatch: pytest.MonkeyPatch,
                **overrides: Any) -> transformers.PreTrainedModel:
    """The tiny HF checkpoint of `arch` (tests/models/tiny_checkpoints.py), saved in `folder`."""
    name, changes = CASES[arch]
    config_cls, kwargs = CONFIGS[name]
    monkeypatch.setitem(CONFIGS, f"{name}_gguf", (config_cls, {**kwargs, **changes, **overrides}))
    return make_checkpoint(f"{name}_gguf", folder)


def _write(model: transformers.PreTrainedModel, path: Path,
           quant: GGMLQuantizationType = F32) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    config = model.config
    return str(write_gguf(config.model_type, model.state_dict(), config.to_dict(), path, quant))


def _hf_weights(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (a tied one has no lm_head)."""
    tied = model.config.tie_word_embeddings
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


def _as_stored(arch: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What an F32 file gives back exactly: Gemma norms went through float32 (w + 1) - 1."""
    return (tensor + 1) - 1 if arch == "gemma2" and name.endswith("norm.weight") else tensor


def _f32(value: Any) -> Any:
    return np.float32(value) if isinstance(value, float) else value


def _config_keys(arch: str) -> tuple[str, ...]:
    return COMMON_KEYS + (GEMMA2_KEYS if arch == "gemma2" else ())


@pytest.mark.parametrize("arch", ARCHS)
def test_config_matches_hf_checkpoint(arch: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = _checkpoint(arch, tmp_path / "hf", monkeypatch)
    cfg = gguf_to_hf_config(read_gguf(_write(model, tmp_path / "gguf" / "f32.gguf")))
    ours, theirs = hf_config_from_dict(cfg), model.config
    for key in _config_keys(arch):
        assert getattr(ours, key) == getattr(theirs, key), key
    ours_mc, theirs_mc = ModelConfig(ours), ModelConfig(theirs)
    for key in ("architecture", "head_dim", "num_key_value_heads", "attention_bias",
                "o_proj_bias", "tie_word_embeddings", "sliding_window", "rope_type"):
        assert getattr(ours_mc, key) == getattr(theirs_mc, key), key
    windows = [ours_mc.layer_sliding_window(i) for i in range(ours_mc.num_hidden_layers)]
    assert windows == [theirs_mc.layer_sliding_window(i)
                       for i in range(theirs_mc.num_hidden_layers)]
    if arch == "gemma2":
        assert windows == [24, None]  # llama.cpp windows the even layers


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_weights_are_the_hf_checkpoint(arch: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    model = _checkpoint(arch, tmp_path / "hf", monkeypatch)
    expected = _hf_weights(model)
    loaded = dict(iter_gguf_file_weights(_write(model, tmp_path / "gguf" / "f32.gguf")))
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == torch.float32, name
        torch.testing.assert_close(loaded[name], _as_stored(arch, name, tensor),
                                   rtol=0, atol=0, msg=name)
        # Gemma norms: within the ulp the converter's w + 1 cost, not off by the 1
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=GEMMA_NORM_ULP, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_weights_are_close(arch: str, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = _checkpoint(arch, tmp_path / "hf", monkeypatch)
    path = _write(model, tmp_path / "gguf" / "q8.gguf", Q8_0)
    assert read_gguf(path).tensors["blk.0.attn_q.weight"].ggml_type == Q8_0
    loaded = dict(iter_gguf_file_weights(path))
    for name, tensor in _hf_weights(model).items():
        scale = tensor.abs().max().item()
        assert (loaded[name] - tensor).abs().max().item() <= scale / 100, name


@pytest.mark.parametrize("quant", [F32, Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_gguf_import_agrees(arch: str, quant: GGMLQuantizationType, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' GGUF import of the same file gives the same tensors and config. Its Qwen3
    import ignores `qwen3.attention.key_length` (Qwen3Config's head_dim 128 stays), so the Qwen3
    file here has head_dim 128; its Gemma-2 import reads neither soft-cap."""
    pytest.importorskip("accelerate")  # transformers loads GGUF files only with it installed
    overrides = {"head_dim": 128} if arch == "qwen3" else {}
    model = _checkpoint(arch, tmp_path / "hf", monkeypatch, **overrides)
    path = Path(_write(model, tmp_path / "gguf" / "model.gguf", quant))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    theirs = reference.state_dict()
    ours = dict(iter_gguf_file_weights(str(path)))
    assert set(ours) <= set(theirs)
    assert set(theirs) - set(ours) <= {"lm_head.weight"}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)
    cfg = hf_config_from_dict(gguf_to_hf_config(read_gguf(str(path))))
    keys = COMMON_KEYS[1:] + (TRANSFORMERS_GEMMA2_KEYS if arch == "gemma2" else ())
    for key in keys:  # transformers keeps float32 metadata widened (rms_norm_eps 9.9999997e-06)
        assert _f32(getattr(cfg, key)) == _f32(getattr(reference.config, key)), key


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_on_f32_gguf_gives_hf_greedy_tokens(arch: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = _checkpoint(arch, tmp_path / "hf", monkeypatch)
    path = _write(model, tmp_path / "gguf" / "f32.gguf")
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    # longer than Gemma's window of 24, and chunked
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (45, 70)]
    new_tokens = 24
    expected = [hf_greedy(model, ids, new_tokens) for ids in prompts]
    engine = radixserve.Engine(path, dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=2048, chunked_prefill_size=32)
    try:
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        got = engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        engine.shutdown()
    assert [r["output_ids"] for r in got] == expected


def test_gemma2_config_without_optional_keys_takes_llama_cpp_defaults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _checkpoint("gemma2", tmp_path / "hf", monkeypatch)
    gguf_file = read_gguf(_write(model, tmp_path / "gguf" / "f32.gguf"))
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window"):
        del gguf_file.metadata[f"gemma2.{key}"]
    gguf_file.metadata["gemma2.attention.key_length"] = 32  # head_dim != hidden / heads = 16
    cfg = gguf_to_hf_config(gguf_file)
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (50.0, 30.0)
    assert cfg["sliding_window"] == 4096 and cfg["rope_theta"] == 10000.0
    assert cfg["query_pre_attn_scalar"] == 32  # head_dim, as for Gemma-2 2B and 9B
    gguf_file.metadata["gemma2.block_count"] = 46  # Gemma-2 27B: hidden / heads
    assert gguf_to_hf_config(gguf_file)["query_pre_attn_scalar"] == 16
