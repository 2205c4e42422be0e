"""GGUF -> HF config and weights: bundled SmolLM2 and tiny llama.cpp-style files written here."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from radixserve.core.model_config import ModelConfig
from radixserve.loader.gguf_file import read_gguf
from radixserve.loader.gguf_loader import (dequantize_tensor, gguf_to_hf_config,
                                           iter_gguf_file_weights, load_gguf_hf_config)

from loader_test_utils import TINY_LLAMA, make_tiny_llama, write_llama_gguf

Rope = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def test_reader_matches_gguf_reference_reader(bundled_gguf: str) -> None:
    ours = read_gguf(bundled_gguf)
    ref = gguf.GGUFReader(bundled_gguf)
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == ref_meta
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert info.ggml_type == t.tensor_type
        assert info.data_offset == t.data_offset
    # the dequantized values agree with gguf's own reader for each storage type in the file
    by_type = {}
    for t in ref.tensors:
        by_type.setdefault(t.tensor_type, t)
    assert {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
            GGMLQuantizationType.F32} <= set(by_type)
    for t in by_type.values():
        expected = dequantize(t.data, t.tensor_type).reshape(ours.tensors[t.name].shape)
        got = dequantize_tensor(ours, ours.tensors[t.name])
        assert got.dtype == torch.float32
        np.testing.assert_array_equal(got.numpy(), expected)


def test_bundled_config(bundled_gguf: str) -> None:
    cfg = load_gguf_hf_config(bundled_gguf)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["hidden_size"] == 576
    assert cfg["head_dim"] == 64
    assert cfg["intermediate_size"] == 1536
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    model_config = ModelConfig.from_hf_dict(cfg)
    assert model_config.eos_token_ids == [2] and model_config.tie_word_embeddings
    assert load_gguf_hf_config(bundled_gguf) == cfg  # second read comes from the cache


def test_bundled_weights_have_transformers_names_and_shapes(bundled_gguf: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = load_gguf_hf_config(bundled_gguf)
    with torch.device("meta"):
        reference = LlamaForCausalLM(LlamaConfig(**cfg))
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()
                if k != "lm_head.weight"}  # tied: the checkpoint has no separate lm_head
    got = {}
    for name, tensor in iter_gguf_file_weights(bundled_gguf):
        assert tensor.dtype == torch.float32, name
        got[name] = tuple(tensor.shape)
        if name.startswith("model.layers.0.") or not name.startswith("model.layers."):
            assert torch.isfinite(tensor).all() and tensor.abs().max() > 0, name
    assert got == expected


@pytest.mark.parametrize("tie", [False, True])
def test_tiny_f32_gguf_round_trips_exactly(tmp_path: Path, tie: bool) -> None:
    model = make_tiny_llama(tie_word_embeddings=tie)
    state = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    path = write_llama_gguf(state, TINY_LLAMA, tmp_path / "tiny.gguf")
    cfg = gguf_to_hf_config(read_gguf(str(path)))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "rms_norm_eps", "rope_theta"):
        assert cfg[key] == TINY_LLAMA[key], key
    assert cfg["tie_word_embeddings"] is tie
    loaded = dict(iter_gguf_file_weights(str(path)))
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        torch.testing.assert_close(loaded[name], tensor.float(), rtol=0, atol=0, msg=name)


def test_tiny_q8_0_gguf_is_close(tmp_path: Path) -> None:
    model = make_tiny_llama()
    state = model.state_dict()
    path = write_llama_gguf(state, TINY_LLAMA, tmp_path / "q8.gguf",
                            quant=GGMLQuantizationType.Q8_0)
    assert read_gguf(str(path)).tensors["blk.0.attn_q.weight"].ggml_type == \
        GGMLQuantizationType.Q8_0
    loaded = dict(iter_gguf_file_weights(str(path)))
    for name, tensor in state.items():
        scale = tensor.abs().max().item()
        assert (loaded[name] - tensor).abs().max().item() <= scale / 100, name


def _rope_neox(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """HF layout: rotate pairs (i, i + d/2)."""
    d = x.shape[-1]
    freqs = pos[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = freqs.cos().repeat(1, 2)[:, None], freqs.sin().repeat(1, 2)[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def _rope_gptj(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's layout for Llama GGUFs: rotate adjacent pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    freqs = pos[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def test_unpermuted_qk_give_the_attention_scores_llama_cpp_computes(tmp_path: Path) -> None:
    """The file's q/k rows with GPT-J rope (what llama.cpp runs) and our un-permuted rows with
    HF rope give the same q.k scores; the raw file rows with HF rope do not."""
    model = make_tiny_llama()
    path = write_llama_gguf(model.state_dict(), TINY_LLAMA, tmp_path / "tiny.gguf")
    gguf_file = read_gguf(str(path))
    ours = dict(iter_gguf_file_weights(str(path)))
    n_heads, n_kv, head_dim = 4, 2, 16
    tokens, theta = 7, TINY_LLAMA["rope_theta"]
    x = torch.randn(tokens, TINY_LLAMA["hidden_size"], dtype=torch.float64)
    pos = torch.arange(tokens, dtype=torch.float64)

    def scores(wq: torch.Tensor, wk: torch.Tensor, rope: Rope) -> torch.Tensor:
        q = rope((x @ wq.double().T).view(tokens, n_heads, head_dim), pos, theta)
        k = rope((x @ wk.double().T).view(tokens, n_kv, head_dim), pos, theta)
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        return torch.einsum("qhd,khd->hqk", q, k)

    raw_q = dequantize_tensor(gguf_file, gguf_file.tensors["blk.1.attn_q.weight"])
    raw_k = dequantize_tensor(gguf_file, gguf_file.tensors["blk.1.attn_k.weight"])
    llama_cpp = scores(raw_q, raw_k, _rope_gptj)
    hf = scores(ours["model.layers.1.self_attn.q_proj.weight"],
                ours["model.layers.1.self_attn.k_proj.weight"], _rope_neox)
    torch.testing.assert_close(hf, llama_cpp, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(scores(raw_q, raw_k, _rope_neox), llama_cpp, atol=1e-3)
