"""FP8 checkpoints in each supported format load and give the logits of their dequantised twin
(CPU: the reference path dequantises the FP8 weights, so the two must agree to float error):
`quant_method: fp8` with block scales, compressed-tensors per-tensor (static input scales) and
per-channel (dynamic) float8, and --quantization fp8 on a bf16-style checkpoint. The hybrid
models' linear-attention projections are quantised too, their scales regrouped with their rows
(Qwen3-Next's per-key-head layout, Qwen3.5's stacked q | k | v)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.config import ServerArgs
from radixserve.executor.model_runner import ModelRunner
from radixserve.layers.quantization.fp8 import quantize_per_channel
from tests.models.runner_driver import RunnerDriver
from tests.models.tiny_checkpoints import make_checkpoint

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj",  # stored merged (Phi-3)
           "w1", "w2", "w3", "kv_a_proj_with_mqa", "kv_b_proj",  # Mixtral experts, MLA
           "q_a_proj", "q_b_proj",  # MLA with q compression (DeepSeek-V3's FP8 release)
           # Gated DeltaNet: Qwen3-Next's grouped projections, Qwen3.5's separate ones
           "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
           "out_proj", "in_proj")  # Mamba-2 (Nemotron-H; its experts' up / down as above)
FP8 = torch.float8_e4m3fn


def _quantize(w: torch.Tensor, fmt: str,
              block: int = 32) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Checkpoint tensors of one FP8 linear (suffix -> tensor) and its dequantised weight."""
    if fmt == "block":
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        padded = torch.zeros(rows * block, cols * block)
        padded[:w.shape[0], :w.shape[1]] = w
        amax = padded.view(rows, block, cols, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale = amax / 448
        expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        expanded = expanded[:w.shape[0], :w.shape[1]]
        codes = (w / expanded).clamp(-448, 448).to(FP8)
        return {"weight": codes, "weight_scale_inv": scale}, codes.float() * expanded
    if fmt == "tensor":
        scale = w.abs().max() / 448
        codes = (w / scale).clamp(-448, 448).to(FP8)
        return ({"weight": codes, "weight_scale": scale.reshape(1),
                 "input_scale": torch.tensor([0.05])}, codes.float() * scale)
    codes, scale = quantize_per_channel(w)  # channel
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale


def _quant_config(fmt: str) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": [32, 32]}
    strategy = "tensor" if fmt == "tensor" else "channel"
    inputs = {"num_bits": 8, "type": "float", "symmetric": True,
              "strategy": "tensor" if fmt == "tensor" else "token",
              "dynamic": fmt != "tensor"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": inputs,
                                          "weights": {"num_bits": 8, "type": "float",
                                                      "symmetric": True, "dynamic": False,
                                                      "strategy": strategy}}},
            "ignore": ["lm_head"]}


def _write_pair(root: Path, fmt: str, model: str = "llama_gqa_llama3_rope",
                skip: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """(FP8 checkpoint, its dequantised twin), from one tiny random checkpoint (an MoE model's
    experts are quantised too; its router stays as it is). Linears whose names contain an
    entry of `skip` stay unquantised, listed in the config as checkpoints list them."""
    base = root / "base"
    make_checkpoint(model, base)
    tensors = load_file(str(base / "model.safetensors"))
    fp8, twin = {}, {}
    for name, t in tensors.items():
        module = name.rsplit(".", 2)
        if name.endswith(".weight") and module[-2] in LINEARS and \
                not any(re.match(e[3:], name[:-len(".weight")]) if e.startswith("re:")
                        else e in name for e in skip):
            pieces, dequant = _quantize(t.float(), fmt)
            for suffix, piece in pieces.items():
                fp8[name[:-len("weight")] + suffix] = piece.contiguous()
            twin[name] = dequant
        else:
            fp8[name] = twin[name] = t
    config = json.loads((base / "config.json").read_text())
    folders = []
    quant = _quant_config(fmt)
    if skip:
        key = "modules_to_not_convert" if fmt == "block" else "ignore"
        quant[key] = [*quant.get(key, []), *skip]
    for label, state, extra in (("fp8", fp8, {"quantization_config": quant}),
                                ("twin", twin, {})):
        folder = root / label
        folder.mkdir()
        save_file(state, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
        folders.append(folder)
    return folders[0], folders[1]


def _logits(folder: Path, **kwargs: object) -> list[torch.Tensor]:
    runner = ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu",
                                    max_total_tokens=512, max_running_requests=2, **kwargs))
    ids = torch.randint(0, 160, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    driver = RunnerDriver(runner)
    return [driver.extend({0: ids[:20]})[0]] + [driver.extend({0: [t]})[0] for t in ids[20:]]


@pytest.mark.parametrize("fmt,model", [("block", "llama_gqa_llama3_rope"),
                                       ("tensor", "llama_gqa_llama3_rope"),
                                       ("channel", "llama_gqa_llama3_rope"),
                                       ("block", "qwen3_moe"), ("channel", "qwen3_moe"),
                                       ("block", "deepseek_v2_lite_mla"),
                                       ("block", "deepseek_v3_noaux"),
                                       ("block", "glm4_moe_partial_rope"),
                                       ("block", "minimax_m2_qk_norm"),
                                       ("block", "qwen3_next_hybrid"),
                                       ("channel", "qwen3_next_hybrid"),
                                       ("block", "qwen3_5_dense"),
                                       ("block", "phi3_merged_window")])
def test_fp8_checkpoint_matches_its_dequantised_twin(fmt: str, model: str, tmp_path) -> None:
    fp8_folder, twin_folder = _write_pair(tmp_path, fmt, model)
    for got, want in zip(_logits(fp8_folder), _logits(twin_folder)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt,model,skip", [
    # Qwen3-Next / Qwen3.5 FP8 releases keep the linear attention's b|a projection in bf16
    ("block", "qwen3_next_hybrid", ("linear_attn.in_proj_ba",)),
    ("block", "qwen3_5_dense", ("linear_attn.in_proj_b", "linear_attn.in_proj_a")),
    # compressed-tensors' ignore list, by regular expression and by name
    ("channel", "llama_gqa_llama3_rope", ("re:.*layers\\.1\\.mlp\\.down_proj$",
                                          "model.layers.0.self_attn.o_proj"))])
def test_layers_the_checkpoint_leaves_unquantised_load_as_they_are(fmt, model, skip,
                                                                    tmp_path) -> None:
    fp8_folder, twin_folder = _write_pair(tmp_path, fmt, model, skip)
    for got, want in zip(_logits(fp8_folder), _logits(twin_folder)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_merged_layer_half_left_unquantised_is_refused(tmp_path) -> None:
    """q|k|v is one layer: a checkpoint that quantises q and k but not v cannot load."""
    fp8_folder, _ = _write_pair(tmp_path, "block", skip=("self_attn.v_proj",))
    with pytest.raises(ValueError, match="quantises some of the modules merged"):
        _logits(fp8_folder)


@pytest.mark.parametrize("model", ["llama_gqa_llama3_rope", "mixtral_moe", "nemotron_h_moe",
                                   "nemotron_h_latent_moe"])
def test_online_quantization_matches_a_per_channel_twin(model: str, tmp_path) -> None:
    make_checkpoint(model, tmp_path / "bf16")
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    twin = {name: (quantize_per_channel(t.float())[0].float() * quantize_per_channel(t.float())[1]
                   if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS else t)
            for name, t in tensors.items()}
    (tmp_path / "twin").mkdir()
    save_file(twin, str(tmp_path / "twin" / "model.safetensors"))
    (tmp_path / "twin" / "config.json").write_text((tmp_path / "bf16" / "config.json").read_text())
    ours = _logits(tmp_path / "bf16", quantization="fp8")
    for got, want in zip(ours, _logits(tmp_path / "twin")):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    plain = _logits(tmp_path / "bf16")
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(ours, plain))  # it did quantise


def _block_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] (multiples of block) -> (FP8 codes, scales [rows / b, cols / b])."""
    rows, cols = w.shape[0] // block, w.shape[1] // block
    amax = w.view(rows, block, cols, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return (w / expanded).clamp(-448, 448).to(FP8), scale


def test_stacked_fp8_experts_match_their_dequantised_twin(tmp_path) -> None:
    """Mistral-4's experts in one tensor per projection, block-scaled as transformers' FP8
    writes them (`experts.gate_up_proj` codes, `experts.gate_up_proj_scale_inv` [E, 2I/b,
    H/b]): the gate and up halves' scale rows split per expert, as the per-expert layout's."""
    block = 8
    make_checkpoint("mistral4_mla_halves", tmp_path / "base")
    tensors = load_file(str(tmp_path / "base" / "model.safetensors"))
    fp8, twin = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            pairs = [_block_quantize(w.float(), block) for w in t]
            fp8[name] = torch.stack([codes for codes, _ in pairs])
            fp8[f"{name}_scale_inv"] = torch.stack([scale for _, scale in pairs])
            twin[name] = torch.stack([
                codes.float() * scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
                for codes, scale in pairs])
        elif name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            pieces, twin[name] = _quantize(t.float(), "block", block)
            fp8.update({name[:-len("weight")] + suffix: piece.contiguous()
                        for suffix, piece in pieces.items()})
        else:
            fp8[name] = twin[name] = t
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    for label, state, extra in (("fp8", fp8, {"quantization_config": {
            "quant_method": "fp8", "activation_scheme": "dynamic",
            "weight_block_size": [block, block]}}), ("twin", twin, {})):
        (tmp_path / label).mkdir()
        save_file(state, str(tmp_path / label / "model.safetensors"))
        (tmp_path / label / "config.json").write_text(json.dumps({**config, **extra}))
    for got, want in zip(_logits(tmp_path / "fp8"), _logits(tmp_path / "twin")):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_llama4_fp8_release_layout_matches_its_dequantised_twin(tmp_path) -> None:
    """Llama-4's FP8 release (compressed-tensors, per-channel weights, dynamic per-token
    activations): experts one by one (`feed_forward.experts.{e}.gate_proj.weight`, ...), the
    router and the LM head unquantised; q and k's per-channel scales are permuted with their
    rows at load (rope pairs to halves), so the logits are the dequantised twin's."""
    make_checkpoint("llama4_scout", tmp_path / "base")
    tensors = load_file(str(tmp_path / "base" / "model.safetensors"))
    fp8, twin = {}, {}

    def put(name: str, weight: torch.Tensor) -> None:
        pieces, dequant = _quantize(weight.float(), "channel")
        twin[name] = dequant.contiguous()
        fp8.update({name[:-len("weight")] + suffix: piece.contiguous()
                    for suffix, piece in pieces.items()})

    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = name.rsplit(".", 1)[0]
            for expert, matrix in enumerate(t.transpose(1, 2)):  # [2I, H] / [H, I]
                if name.endswith("gate_up_proj"):
                    gate, up = matrix.chunk(2)
                    put(f"{prefix}.{expert}.gate_proj.weight", gate)
                    put(f"{prefix}.{expert}.up_proj.weight", up)
                else:
                    put(f"{prefix}.{expert}.down_proj.weight", matrix)
        elif name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            put(name, t)
        else:
            fp8[name] = twin[name] = t
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    quant = {**_quant_config("channel"), "ignore": ["lm_head", "re:.*router"]}
    for label, state, extra in (("fp8", fp8, {"quantization_config": quant}), ("twin", twin, {})):
        (tmp_path / label).mkdir()
        save_file(state, str(tmp_path / label / "model.safetensors"))
        (tmp_path / label / "config.json").write_text(json.dumps({**config, **extra}))
    for got, want in zip(_logits(tmp_path / "fp8"), _logits(tmp_path / "twin")):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
