"""Int4 (W4A16) checkpoints of the tiny models, in AWQ, GPTQ and compressed-tensors layouts,
each with its dequantised twin (the same weights in float32, which transformers and the plain
layers load).

The packers here are written from the formats' descriptions, apart from radixserve's unpacking:
AWQ packs output features in the order 0 2 4 6 1 3 5 7 into each int32 ([K, N / 8]); GPTQ
packs input features in order ([K / 8, N]) and stores zero points minus one; compressed-tensors
packing comes from the compressed-tensors library itself (`pack_to_int32`).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.models.tiny_checkpoints import make_checkpoint

DENSE_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 "w1", "w2", "w3")  # the last three: Mixtral's experts
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def fake_quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, symmetric: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (codes uint8 [N, K] 0..15, scales [N, G], zeros uint8 [N, G]), each
    input feature k in group g_idx[k]."""
    n, k = w.shape
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.uint8)
    codes = torch.empty(n, k, dtype=torch.uint8)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        part = w[:, cols]
        if symmetric:
            scale = (part.abs().amax(dim=1) / 7.5).clamp(min=1e-6)
            zero = torch.full((n,), 8.0)
        else:
            lo, hi = part.amin(dim=1).clamp(max=0), part.amax(dim=1).clamp(min=0)
            scale = ((hi - lo) / 15).clamp(min=1e-6)
            zero = (-lo / scale).round().clamp(0, 15)
        scale = scale.half().float()  # the checkpoints store fp16 scales
        q = (part / scale[:, None] + zero[:, None]).round().clamp(0, 15)
        codes[:, cols] = q.to(torch.uint8)
        scales[:, g], zeros[:, g] = scale, zero.to(torch.uint8)
    return codes, scales, zeros


def dequantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                g_idx: torch.Tensor) -> torch.Tensor:
    index = g_idx.long()
    return (codes.float() - zeros.float()[:, index]) * scales[:, index]


def _pack_words(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[R, 8C] uint8 -> int32 [R, C]: column 8c + order[i] in nibble i of word c."""
    rows, cols = values.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, column in enumerate(order):
        out |= values[:, column::8].to(torch.int64) << (4 * i)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def awq_tensors(codes, scales, zeros) -> dict[str, torch.Tensor]:
    return {"qweight": _pack_words(codes.t().contiguous(), AWQ_ORDER),
            "qzeros": _pack_words(zeros.t().contiguous(), AWQ_ORDER),
            "scales": scales.t().contiguous().half()}


def gptq_tensors(codes, scales, zeros, g_idx) -> dict[str, torch.Tensor]:
    n = codes.shape[0]
    qweight = _pack_words(codes, tuple(range(8))).t().contiguous()  # [K / 8, N]
    stored = (zeros.to(torch.int64) - 1) & 0xF  # the original format's z - 1
    return {"qweight": qweight,
            "qzeros": _pack_words(stored.t().contiguous().to(torch.uint8), tuple(range(8))),
            "scales": scales.t().contiguous().half(), "g_idx": g_idx.to(torch.int32),
            "bias": torch.zeros(n, dtype=torch.float16)}  # AutoGPTQ saves one per layer


def ct_tensors(codes, scales, zeros, g_idx, symmetric: bool, act_order: bool
               ) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    out = {"weight_packed": pack_to_int32((codes.to(torch.int16) - 8).to(torch.int8), 4),
           "weight_scale": scales.clone(), "weight_shape": torch.tensor(list(codes.shape))}
    if not symmetric:
        out["weight_zero_point"] = pack_to_int32((zeros.to(torch.int16) - 8).to(torch.int8), 4,
                                                 packed_dim=0)
    if act_order:
        out["weight_g_idx"] = g_idx.to(torch.int32)
    return out


def quant_config(method: str, group: int, symmetric: bool, act_order: bool,
                 skipped: tuple[str, ...] = ()) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                "zero_point": not symmetric, "modules_to_not_convert": list(skipped) or None}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                "sym": symmetric, "checkpoint_format": "gptq"}
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
               "group_size": group, "dynamic": False}
    if act_order:
        weights["actorder"] = "group"
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "format": "pack-quantized"}},
            "ignore": ["lm_head", *skipped]}


def write_int4_pair(root: Path, method: str, model: str = "llama_gqa_llama3_rope",
                    group: int = 32, symmetric: bool = False, act_order: bool = False,
                    skipped: tuple[str, ...] = (), seed: int = 0,
                    base: Path | None = None) -> tuple[Path, Path]:
    """(int4 checkpoint, its dequantised twin) of one tiny model (or of the checkpoint already
    in `base`; its other files, a tokenizer's, are copied to both). Act-order checkpoints group
    the input features of each layer in a random order (shared by the layers that read the
    same input, as GPTQ's order follows the input's statistics)."""
    if base is None:
        base = root / "base"
        make_checkpoint(model, base, seed)
    tensors = load_file(str(base / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 7)
    orders: dict[tuple[str, int], torch.Tensor] = {}
    quant, twin = {}, {}
    for name, t in tensors.items():
        parts = name.rsplit(".", 2)
        if not (name.endswith(".weight") and parts[-2] in DENSE_LINEARS) or \
                any(s in name for s in skipped):
            quant[name] = twin[name] = t
            continue
        w = t.float()
        k = w.shape[1]
        assert k % group == 0, f"{name}: {k} input features, groups of {group}"
        if act_order:  # q|k|v share their input's order, as do gate|up
            reader = "attn_in" if parts[-2] in ("q_proj", "k_proj", "v_proj") else \
                "mlp_in" if parts[-2] in ("gate_proj", "up_proj") else parts[-2]
            key = (parts[0] + reader, k)
            if key not in orders:
                orders[key] = torch.randperm(k, generator=gen)
            g_idx = torch.empty(k, dtype=torch.long)
            g_idx[orders[key]] = torch.arange(k) // group
        else:
            g_idx = torch.arange(k) // group
        codes, scales, zeros = fake_quantize(w, g_idx, k // group, symmetric)
        prefix = name[:-len("weight")]
        if method == "awq":
            pieces = awq_tensors(codes, scales, zeros)
        elif method == "gptq":
            pieces = gptq_tensors(codes, scales, zeros, g_idx)
        else:
            pieces = ct_tensors(codes, scales, zeros, g_idx, symmetric, act_order)
        quant.update({prefix + suffix: piece for suffix, piece in pieces.items()})
        twin[name] = dequantized(codes, scales, zeros, g_idx)
    config = json.loads((base / "config.json").read_text())
    folders = []
    qc = quant_config(method, group, symmetric, act_order, skipped)
    for label, state, extra in ((method, quant, {"quantization_config": qc}), ("twin", twin, {})):
        folder = root / label
        folder.mkdir()
        for other in base.iterdir():  # tokenizer files, generation config
            if other.is_file() and other.name not in ("model.safetensors", "config.json"):
                shutil.copy(other, folder / other.name)
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
        folders.append(folder)
    return folders[0], folders[1]
