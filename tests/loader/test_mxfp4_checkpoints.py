"""gpt-oss's MXFP4 experts: the dequantisation against transformers' own, a tiny gpt-oss
checkpoint written with MXFP4 experts (as the released ones: `quant_method: mxfp4`,
`{projection}_blocks` / `_scales` in [E, out, in] order) against its dequantised bf16-layout
twin, a checkpoint missing one half refused, and --quantization fp8 on the MXFP4 experts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.layers.quantization.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from radixserve.loader.checkpoint_error import CheckpointError
from radixserve.layers.quantization.fp8 import quantize_per_channel
from tests.loader.test_fp8_checkpoints import LINEARS, _logits
from tests.models.tiny_checkpoints import make_checkpoint

MODEL = "gpt_oss_sinks_window"


def test_dequantisation_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(3, 40, 96) * torch.logspace(-3, 2, 96)  # blocks of many exponents
    blocks, scales = quantize_mxfp4(weight)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours, theirs.transpose(1, 2))
    # the nearest code of the block's scale: the error is at most half a step of 6 * 2^e's grid
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    assert bool(((ours - weight).abs() <= step + 1e-6).all())


def _write_pair(root: Path, drop: str | None = None) -> tuple[Path, Path]:
    """(MXFP4 checkpoint, its dequantised twin) from one tiny random gpt-oss checkpoint; `drop`
    leaves that tensor out of the MXFP4 one."""
    base = root / "base"
    make_checkpoint(MODEL, base)
    tensors = load_file(str(base / "model.safetensors"))
    mxfp4, twin = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.float().transpose(1, 2))  # [E, out, in]
            mxfp4[f"{name}_blocks"], mxfp4[f"{name}_scales"] = blocks, scales
            twin[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)
        else:
            mxfp4[name] = twin[name] = tensor
    if drop is not None:
        del mxfp4[drop]
    config = json.loads((base / "config.json").read_text())
    folders = []
    for label, state, extra in (("mxfp4", mxfp4, {"quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                "lm_head"]}}), ("twin", twin, {})):
        folder = root / label
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in state.items()},
                  str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
        folders.append(folder)
    return folders[0], folders[1]


def test_mxfp4_checkpoint_matches_its_dequantised_twin(tmp_path: Path) -> None:
    mxfp4, twin = _write_pair(tmp_path)
    for got, want in zip(_logits(mxfp4), _logits(twin)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_missing_half_is_refused(tmp_path: Path) -> None:
    mxfp4, _ = _write_pair(tmp_path, drop="model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises((CheckpointError, ValueError), match="down_proj|w2"):
        _logits(mxfp4)


def _per_channel(weight: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_per_channel(weight.float())
    return codes.float() * scales


def test_fp8_quantisation_of_mxfp4_experts(tmp_path: Path) -> None:
    """--quantization fp8: the dequantised experts become per-channel FP8 (per output row of
    each expert), as the attention's linears do: the logits of a twin holding those values."""
    mxfp4, twin = _write_pair(tmp_path)
    tensors = load_file(str(twin / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]
            tensors[name] = torch.stack([_per_channel(w.t()).t() for w in tensor])
        elif name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            tensors[name] = _per_channel(tensor)
    save_file(tensors, str(twin / "model.safetensors"))
    for got, want in zip(_logits(mxfp4, quantization="fp8"), _logits(twin)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # 10 s
def test_mxfp4_checkpoint_at_tp2_matches_tp1(tmp_path: Path) -> None:
    """Each rank dequantises the experts and keeps its part of the intermediate size."""
    from tests.distributed.test_tensor_parallel import _prompts, _run

    mxfp4, _ = _write_pair(tmp_path)
    prompts = _prompts(160)
    one, two = _run(str(mxfp4), 1, prompts), _run(str(mxfp4), 2, prompts)
    assert two["ids"] == one["ids"]
    torch.testing.assert_close(torch.tensor(two["logprobs"]), torch.tensor(one["logprobs"]),
                               atol=1e-4, rtol=1e-4)
