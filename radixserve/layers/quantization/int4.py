"""4-bit integer weights with 16-bit activations (W4A16): what a checkpoint asks for, and its
tensors turned into the one layout the layers keep.

Formats read (each a `quantization_config` in config.json):
  * AWQ (`quant_method: awq`, AutoAWQ's GEMM packing): `qweight` int32 [K, N / 8] packed along
    the output features in AWQ's interleaved order, `qzeros` int32 [K / g, N / 8] the same way,
    `scales` [K / g, N]; w = (q - z) * s;
  * GPTQ (`quant_method: gptq`, AutoGPTQ / GPTQModel): `qweight` int32 [K / 8, N] packed along
    the input features in order, `qzeros` int32 [K / g, N / 8] holding z - 1 (`gptq_v2`: z),
    `scales` [K / g, N], `g_idx` [K] (each input feature's group: `desc_act` checkpoints
    quantised the features in another order than their position);
  * compressed-tensors `pack-quantized` int4 (llm-compressor's W4A16): `weight_packed` int32
    [N, K / 8] (q + 8, in order), `weight_scale` [N, K / g], `weight_zero_point` packed along
    the output features when asymmetric, `weight_shape`, `weight_g_idx` with group act-order.
Every layer keeps the codes as unsigned nibbles (0..15) of int32 words [N, K / 8] along the
input features in order (word c holds features 8c .. 8c + 7 in bits 0-3, 4-7, ...), scales
[N, K / g] in the compute dtype, and the zero points [N, K / g] (uint8; none where every zero is
8, the symmetric case). A checkpoint quantised out of order (`g_idx`) keeps its input features
permuted so that each group is contiguous, and permutes the activations to match.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.layers.quantization.build_setting import BuildSetting
from radixserve.layers.quantization.compressed_tensors import single_scheme

INT4_METHODS = ("awq", "gptq")  # the quant_method values this module reads (and CT int4)
PACK = 8  # int4 values per int32 word
SYMMETRIC_ZERO = 8  # the zero point of symmetric (signed) int4: codes 0..15 stand for -8..7
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's word: nibble i holds output feature 8c + AWQ_ORDER[i]
SEQUENTIAL = tuple(range(PACK))
# --quantization values that name an int4 checkpoint's method (vLLM's spellings, kernels aside)
INT4_FLAGS = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq",
              "compressed-tensors": "compressed-tensors"}


@dataclass(frozen=True)
class Int4Config:
    method: str  # "awq" | "gptq" | "compressed-tensors"
    group_size: int  # input features per scale group; -1: one group per row (per channel)
    symmetric: bool  # no zero-point tensor in the checkpoint (zero 8)
    act_order: bool = False  # the checkpoint carries each input feature's group (g_idx)
    zeros_minus_one: bool = False  # GPTQ's original format stores z - 1
    skipped: tuple[str, ...] = ()  # checkpoint modules left unquantised (see skipped.py)
    source: str = ""  # for the log
    dummy: bool = False  # --quantization on dummy weights: no checkpoint tensors to expect

    @property
    def names(self) -> dict[str, str]:
        """The checkpoint's tensor names for codes, scales, zeros, g_idx."""
        if self.method == "compressed-tensors":
            return {"codes": "weight_packed", "scales": "weight_scale",
                    "zeros": "weight_zero_point", "g_idx": "weight_g_idx"}
        return {"codes": "qweight", "scales": "scales", "zeros": "qzeros", "g_idx": "g_idx"}

    def bytes_per_weight(self, scale_bytes: int, group: int = 4096) -> float:
        """A packed weight's bytes per value: half a byte, plus its group's scale and zero
        point (per-channel groups counted as `group` features)."""
        size = self.group_size if self.group_size > 0 else group
        return 0.5 + (scale_bytes + (0 if self.symmetric else 1)) / size

    def group_of(self, input_size: int) -> int:
        """Input features per group of a layer with `input_size` of them (whole checkpoint)."""
        return input_size if self.group_size == -1 else self.group_size


def is_int4_checkpoint(quantization_config: dict[str, Any] | None) -> bool:
    """Whether the checkpoint's quantization_config is one this module reads."""
    config = quantization_config or {}
    method = config.get("quant_method")
    if method in INT4_METHODS:
        return True
    if method != "compressed-tensors":
        return False
    for group in (config.get("config_groups") or {}).values():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") == "int":
            return True
    return False


def int4_config(quantization_config: dict[str, Any] | None, flag: str | None,
                dummy: bool = False) -> Int4Config | None:
    """The int4 setting of a checkpoint's `quantization_config` and the --quantization flag
    (which must name the checkpoint's method when given). With dummy weights and no
    quantization_config, --quantization awq / gptq builds int4 layers of that format's usual
    setting (groups of 128; AWQ asymmetric, GPTQ symmetric) for shape-only runs."""
    wanted = INT4_FLAGS.get(flag or "")
    if not is_int4_checkpoint(quantization_config):
        method = (quantization_config or {}).get("quant_method")
        if wanted is None or wanted == method:  # compressed-tensors FP8: fp8.py's
            return None
        if dummy and not quantization_config:
            return Int4Config(method=wanted, group_size=128, symmetric=wanted != "awq",
                              dummy=True,
                              source=f"--quantization {flag} on dummy weights (groups of 128)")
        raise ValueError(f"--quantization {flag} needs a checkpoint quantised that way; this "
                         "one is not")
    assert quantization_config is not None
    method = quantization_config["quant_method"]
    if flag is not None and wanted != method:
        raise ValueError(f"--quantization {flag} does not match the checkpoint's {method} "
                         "quantization (leave the flag out to serve it as it is)")
    if method == "awq":
        return _awq_config(quantization_config)
    if method == "gptq":
        return _gptq_config(quantization_config)
    return _compressed_tensors_int4(quantization_config)


def _bits(raw: dict[str, Any], *keys: str) -> int:
    for key in keys:
        if key in raw:
            return int(raw[key])
    return 4


def _awq_config(raw: dict[str, Any]) -> Int4Config:
    bits = _bits(raw, "bits", "w_bit")
    version = str(raw.get("version", "gemm")).lower()
    if bits != 4:
        raise ValueError(f"AWQ with {bits}-bit weights is not supported (4-bit only)")
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported: its packing differs from "
                         "the GEMM version's, which radixserve reads")
    group = int(raw.get("group_size", raw.get("q_group_size", 128)))
    zero_point = bool(raw.get("zero_point", True))
    skipped = tuple(raw.get("modules_to_not_convert") or ())
    return Int4Config("awq", group, symmetric=not zero_point, skipped=skipped,
                      source=f"AWQ int4 (groups of {group}"
                             f"{', zero points' if zero_point else ''})")


def _gptq_config(raw: dict[str, Any]) -> Int4Config:
    bits = _bits(raw, "bits")
    if bits != 4:
        raise ValueError(f"GPTQ with {bits}-bit weights is not supported (4-bit only)")
    if raw.get("lm_head"):
        raise ValueError("GPTQ checkpoints with a quantised LM head are not supported")
    fmt = str(raw.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    if raw.get("dynamic"):
        raise ValueError("GPTQ checkpoints with per-module overrides (GPTQModel's `dynamic`) "
                         "are not supported")
    if str(raw.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
        raise ValueError(f"GPTQ pack_dtype {raw['pack_dtype']!r} is not supported (int32)")
    group = int(raw.get("group_size", 128))
    act_order = bool(raw.get("desc_act", False))
    sym = bool(raw.get("sym", True))
    skipped = tuple(raw.get("modules_to_not_convert") or ())
    return Int4Config("gptq", group, symmetric=False, act_order=act_order,
                      zeros_minus_one=fmt == "gptq", skipped=skipped,
                      source=f"GPTQ int4 (groups of {group}, "
                             f"{'symmetric' if sym else 'zero points'}"
                             f"{', act-order' if act_order else ''})")


def _compressed_tensors_int4(raw: dict[str, Any]) -> Int4Config:
    from compressed_tensors.quantization import QuantizationStrategy
    config, scheme, act_order = single_scheme(raw)
    weights, inputs = scheme.weights, scheme.input_activations
    fmt = str(getattr(scheme, "format", None) or config.format or "")
    if weights is None or weights.num_bits != 4:
        raise ValueError(f"compressed-tensors integer weights {weights} are not 4-bit")
    if inputs is not None:
        raise ValueError("compressed-tensors int4 weights with quantised activations (W4A8) "
                         "are not supported (W4A16 only)")
    if "pack" not in fmt:
        raise ValueError(f"compressed-tensors int4 format {fmt!r} is not supported "
                         "(pack-quantized)")
    if weights.strategy == QuantizationStrategy.GROUP:
        group = int(weights.group_size)
    elif weights.strategy == QuantizationStrategy.CHANNEL:
        group = -1
    else:
        raise ValueError(f"compressed-tensors int4 strategy {weights.strategy} is not supported "
                         "(group, channel)")
    return Int4Config("compressed-tensors", group, symmetric=bool(weights.symmetric),
                      act_order=act_order, skipped=tuple(config.ignore or ()),
                      source="compressed-tensors W4A16 ("
                             f"{f'groups of {group}' if group > 0 else 'per channel'}, "
                             f"{'symmetric' if weights.symmetric else 'zero points'}"
                             f"{', act-order' if act_order else ''})")


# ---- the checkpoint tensors in the layers' orientation ----

def unpack_int32(packed: torch.Tensor, order: tuple[int, ...] = SEQUENTIAL) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: nibble i of word c is column 8c + order[i]."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed int4 tensors are int32, not {packed.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8]: nibble i at [..., i]
    if order != SEQUENTIAL:
        inverse = [order.index(j) for j in range(PACK)]  # column j comes from nibble inverse[j]
        nibbles = nibbles[..., inverse]
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_int32(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K] (values 0..15, K a multiple of 8) -> int32 [R, K / 8], in order."""
    words = codes.reshape(codes.shape[0], -1, PACK).to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)
    return (words << shifts).sum(dim=-1, dtype=torch.int32)


def codes_to_rows(config: Int4Config, loaded: torch.Tensor) -> torch.Tensor:
    """A checkpoint's packed codes -> uint8 [N, K] (0..15)."""
    if config.method == "awq":  # [K, N / 8] along N, interleaved
        return unpack_int32(loaded, AWQ_ORDER).t().contiguous()
    if config.method == "gptq":  # [K / 8, N] along K
        return unpack_int32(loaded.t().contiguous()).contiguous()
    return unpack_int32(loaded)  # compressed-tensors: [N, K / 8] along K


def scales_to_rows(config: Int4Config, loaded: torch.Tensor) -> torch.Tensor:
    """A checkpoint's scales -> [N, groups]."""
    if config.method == "compressed-tensors":
        return loaded if loaded.dim() == 2 else loaded.reshape(-1, 1)
    return loaded.t().contiguous()  # AWQ / GPTQ: [groups, N]


def zeros_to_rows(config: Int4Config, loaded: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's packed zero points -> uint8 [N, groups] (0..16)."""
    if config.method == "awq":  # [groups, N / 8] along N, interleaved
        return unpack_int32(loaded, AWQ_ORDER).t().contiguous()
    if config.method == "gptq":  # [groups, N / 8] along N, z - 1 in the original format
        zeros = unpack_int32(loaded).t().contiguous()
        return zeros + 1 if config.zeros_minus_one else zeros
    # compressed-tensors: [cdiv(N, 8), groups] along N (zero + 8, as the codes)
    return unpack_int32(loaded.t().contiguous()).t()[:rows].contiguous()


MIN_RANK_GROUP = 16  # the narrowest group a rank may keep (the kernels' smallest K step)


def rank_group_size(k_rank: int, group: int) -> int:
    """Input features per scale group on a rank holding k_rank of a layer's input features:
    the checkpoint's group, or where the rank's share starts or ends inside groups the largest
    width dividing both (each such group lies in one checkpoint group and takes its scale;
    Qwen2.5-72B's 29,568 features at tp 8 are 3,696 a rank: groups of 16 against 128)."""
    if k_rank % group == 0:
        return group
    sub = math.gcd(k_rank, group)
    if sub < MIN_RANK_GROUP or sub % PACK:
        raise ValueError(f"int4 groups of {group} input features: each tensor-parallel rank "
                         f"holds {k_rank} of this layer's, which cuts the groups into pieces "
                         f"of {sub} (at least {MIN_RANK_GROUP} needed); choose a --tp-size "
                         "that splits the layer's input at multiples of that")
    return sub


def rank_group_columns(offset: int, k_rank: int, rank_group: int, group: int,
                       device: torch.device | None = None) -> torch.Tensor:
    """The checkpoint group of each of a rank's groups (its features from `offset`)."""
    return (offset + torch.arange(0, k_rank, rank_group, device=device)) // group


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    column_groups: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes [N, K], scales [N, G], zeros [N, G] or None (8), each column's group [K]
    -> the weight [N, K] in dtype: (q - z) * s, in float32."""
    index = column_groups.long()
    scale = scales.float()[:, index]
    zero = SYMMETRIC_ZERO if zeros is None else zeros.float()[:, index]
    return ((codes.float() - zero) * scale).to(dtype)


def dequantize_packed(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      group_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in dtype from the layers' packed words [N, K / 8] over groups of
    group_k input features in order (the reference path)."""
    codes = unpack_int32(qweight)
    columns = torch.arange(codes.shape[1], device=codes.device) // group_k
    return dequantize_int4(codes, scales, zeros, columns, dtype)


def drop_symmetric_zeros(zeros: torch.Tensor | None) -> torch.Tensor | None:
    """Zero points that are all 8 are the symmetric case's: the kernels need none."""
    return None if zeros is None or bool((zeros == SYMMETRIC_ZERO).all()) else zeros


def checkpoint_rows(config: Int4Config, kind: str, loaded: torch.Tensor,
                    rows: int) -> torch.Tensor:
    """A checkpoint's codes ("codes": packed again as the layers' int32 words [N, K / 8]),
    scales or zero points ("scales" / "zeros": [N, groups]) of a piece of `rows` rows."""
    if kind == "codes":
        return pack_int32(codes_to_rows(config, loaded))
    if kind == "scales":
        return scales_to_rows(config, loaded)
    return zeros_to_rows(config, loaded, rows)


def check_weight_shape(loaded: torch.Tensor, rows: int, features: int) -> None:
    """compressed-tensors' weight_shape: the piece's unquantised [rows, input features]."""
    if [int(v) for v in loaded.reshape(-1).tolist()] != [rows, features]:
        raise ValueError(f"weight_shape {loaded.tolist()} does not match the piece's "
                         f"{[rows, features]}")


_SETTING: BuildSetting[Int4Config] = BuildSetting()
int4_linears = _SETTING.use  # with int4_linears(config): layers built inside take this int4 setting
current_int4_config = _SETTING.current
