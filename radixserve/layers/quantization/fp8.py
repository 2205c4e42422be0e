"""FP8 weight quantisation: what a checkpoint (or --quantization fp8) asks for.

Formats read:
  * `quant_method: fp8` with `weight_block_size: [128, 128]` (DeepSeek-V3, Qwen3-FP8): weights
    float8_e4m3fn, one `weight_scale_inv` per 128 x 128 block (value = code x scale);
  * compressed-tensors float formats (Llama FP8 checkpoints), read with the compressed-tensors
    library: 8-bit float weights with a scale per tensor or per output channel (`weight_scale`),
    input activations dynamic per token or static per tensor (`input_scale`);
  * `--quantization fp8` on a bf16/fp16 checkpoint: weights quantised at load, a scale per
    output channel.
Internally every FP8 linear keeps `weight_scale` as [out rows, K groups] float32: one group
(per-tensor and per-channel scales, a per-tensor scale copied to its shard's rows) or one per
128 input columns (block scales, expanded to rows); the matmul reads that one layout. A layer
whose input columns are split over tensor-parallel ranks at a point inside a block (Qwen3-30B-A3B's
768 expert columns over 4 ranks: 192 each, against blocks of 128) keeps finer groups on every
rank (`rank_group_k`: 64 there), each inside one checkpoint block and holding that block's
scale (`rank_block_columns`), so any split the layer's shapes allow loads exactly.
Activations on the GPU: decode rows (1-16) go to the e4m3 tensor cores, quantised per token in
registers or beforehand by the kernel that made them (`Fp8Rows`: RMSNorm and SiLU-mul emit
codes and row scales at 2-128 rows where a swept configuration exists); where no swept configuration says so, the GEMV and the
skinny GEMM multiply bf16 activations with the weights dequantised in registers; large
per-channel batches quantise per token for `torch._scaled_mm`. Static input scales are loaded
but not used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from radixserve.layers.quantization.build_setting import BuildSetting
from radixserve.layers.quantization.compressed_tensors import single_scheme
from radixserve.layers.quantization.int4 import INT4_FLAGS, is_int4_checkpoint

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


class Fp8Rows(NamedTuple):
    """Activation rows already quantised per token for an FP8 linear (by the kernel that made
    them: RMSNorm, SiLU-mul): e4m3 codes [M, K], one float32 scale per row [M, 1], and the
    dtype the product is to return."""
    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    def dequantize(self) -> torch.Tensor:
        return (self.codes.float() * self.scales).to(self.dtype)


FP8_MIN_ROW_SCALE = 1e-12  # an all-zero row still gets a finite scale


def quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype = FP8_DTYPE) -> Fp8Rows:
    """x [M, K] -> per-token FP8 rows (scale amax / FP8 max per row), in PyTorch: the values the
    GPU kernels that emit rows (per_token_quant, RMSNorm's and SiLU-mul's quantising outputs)
    produce."""
    fp8_max = torch.finfo(fp8_dtype).max
    scales = (x.float().abs().amax(dim=1, keepdim=True) / fp8_max).clamp(min=FP8_MIN_ROW_SCALE)
    codes = (x.float() / scales).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return Fp8Rows(codes, scales, x.dtype)


@dataclass(frozen=True)
class Fp8Config:
    block: int | None = None  # 128: block scales; None: per output channel / tensor
    online: bool = False  # quantise the checkpoint's bf16 weights at load
    static_input_scale: bool = False  # the checkpoint carries input_scale tensors
    source: str = ""  # what the config came from, for the log
    # checkpoint modules left unquantised (`modules_to_not_convert` / `ignored_layers`, or
    # compressed-tensors' `ignore`): a name part, or "re:" and a regular expression
    skipped: tuple[str, ...] = ()


def fp8_config(quantization_config: dict[str, Any] | None, flag: str | None) -> Fp8Config | None:
    """The FP8 setting of a checkpoint's `quantization_config` and the --quantization flag."""
    method = (quantization_config or {}).get("quant_method")
    if is_int4_checkpoint(quantization_config):  # int4.py reads it
        if flag == "fp8":
            raise ValueError("--quantization fp8 cannot requantise an int4 checkpoint; serve "
                             "it without the flag, or serve its unquantised original")
        return None
    if flag in INT4_FLAGS:  # int4.py checks the flag against the checkpoint
        flag = None
    if method == "mxfp4":
        # gpt-oss: only its experts are MXFP4, dequantised at load (layers/moe/stacked_experts.py;
        # a model without a place for their blocks is refused by the loader); --quantization
        # fp8 then quantises them as any bf16 weight
        method = None
    if method == "fp8":
        block = quantization_config.get("weight_block_size")  # type: ignore[union-attr]
        if block is not None and (len(block) != 2 or block[0] != block[1]):
            raise ValueError(f"FP8 weight_block_size {block} is not supported (square only)")
        static = quantization_config.get("activation_scheme") == "static"  # type: ignore
        skipped = [*(quantization_config.get("modules_to_not_convert") or ()),  # type: ignore
                   *(quantization_config.get("ignored_layers") or ())]  # type: ignore
        return Fp8Config(block=block[0] if block else None, static_input_scale=static,
                         source=f"fp8 checkpoint{f' (blocks of {block})' if block else ''}",
                         skipped=tuple(skipped))
    if method == "compressed-tensors":
        return _compressed_tensors_config(quantization_config)  # type: ignore[arg-type]
    if method is not None:
        raise ValueError(f"quantization method {method!r} is not supported (fp8, awq, gptq, "
                         "compressed-tensors float8 / int4, gpt-oss's mxfp4)")
    if flag == "fp8":
        return Fp8Config(online=True, source="--quantization fp8 (per-channel, at load)")
    if flag is not None:
        raise ValueError(f"--quantization {flag!r} is not supported (fp8; awq, gptq and "
                         "compressed-tensors name the checkpoint's own method)")
    return None


def _compressed_tensors_config(raw: dict[str, Any]) -> Fp8Config:
    from compressed_tensors.quantization import QuantizationStrategy
    config, scheme, _ = single_scheme(raw)
    weights, inputs = scheme.weights, scheme.input_activations
    if weights is None or weights.num_bits != 8 or str(weights.type) not in ("float",
                                                                              "QuantizationType.FLOAT"):
        raise ValueError(f"compressed-tensors weights {weights} are not FP8 (8-bit float)")
    strategy = weights.strategy
    block = None
    if strategy == QuantizationStrategy.BLOCK:
        block = weights.block_structure[0]
    elif strategy not in (QuantizationStrategy.TENSOR, QuantizationStrategy.CHANNEL):
        raise ValueError(f"compressed-tensors FP8 strategy {strategy} is not supported")
    static = inputs is not None and not inputs.dynamic
    return Fp8Config(block=block, static_input_scale=static, skipped=tuple(config.ignore or ()),
                     source=f"compressed-tensors FP8 ({getattr(strategy, 'value', strategy)} weights, "
                            f"{'static' if static else 'dynamic'} activations)")


_SETTING: BuildSetting[Fp8Config] = BuildSetting()
fp8_linears = _SETTING.use  # with fp8_linears(config): layers built inside take this FP8 setting
current_fp8_config = _SETTING.current


def row_amax(weight: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude, [N, 1] float32 (no float32 copy of the weight)."""
    return torch.linalg.vector_norm(weight, float("inf"), dim=1, keepdim=True).float()


def quantize_per_channel(weight: torch.Tensor, amax: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16/fp32 [N, K] -> (FP8 codes [N, K], scales [N, 1] float32), amax per row -> FP8 max.
    amax: the rows' maxima when the weight is a rank's columns of whole rows (the whole rows'
    scales, so that the codes do not depend on the tensor-parallel split)."""
    amax = (row_amax(weight) if amax is None else amax.to(weight.device, torch.float32)
            ).clamp(min=1e-12)
    scale = amax / FP8_MAX
    codes = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def expand_scale(loaded: torch.Tensor, rows: int, block: int | None) -> torch.Tensor:
    """A checkpoint scale of a piece of `rows` weight rows, as [rows, G] float32: a per-tensor
    scale repeated, a per-channel one as a column, a block one ([cdiv(rows, block),
    cdiv(K, block)]) repeated for each row of its block."""
    loaded = loaded.float()
    if loaded.numel() == 1:
        return loaded.reshape(1, 1).expand(rows, 1)
    if block is not None:
        return loaded.repeat_interleave(block, dim=0)[:rows]
    return loaded.reshape(rows, 1)


MIN_GROUP_K = 16  # the narrowest K group the GPU kernels step through (a 16-deep bf16 MMA)


def rank_group_k(block: int | None, k_rank: int, k_split: bool) -> int | None:
    """The input columns per scale group of a layer holding k_rank input columns on each
    rank (k_split: the checkpoint's columns are split over several ranks): the checkpoint's
    block, unless the split falls inside blocks; then the largest width that divides both the
    block and k_rank, so that every group of every rank lies inside one checkpoint block."""
    if block is None or not k_split or k_rank % block == 0:
        return block
    group = math.gcd(k_rank, block)
    if group < MIN_GROUP_K:
        raise ValueError(
            f"FP8 block scales of {block} columns: each tensor-parallel rank holds {k_rank} "
            f"input columns of this layer, which cut the blocks into groups of {group} (the "
            f"kernels need at least {MIN_GROUP_K}); choose a --tp-size that splits the "
            f"layer's input at block boundaries or at multiples of {MIN_GROUP_K}")
    return group


def rank_block_columns(scale: torch.Tensor, block: int, group_k: int, k_offset: int,
                       k_rank: int) -> torch.Tensor:
    """Block scales already expanded to rows ([rows, cdiv(K, block)]) -> this rank's groups
    [rows, cdiv(k_rank, group_k)]: its group j holds the scale of the checkpoint block that
    contains column k_offset + j * group_k."""
    starts = k_offset + torch.arange(0, k_rank, group_k, device=scale.device)
    return scale[:, starts // block]


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor, block: int | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """FP8 codes [N, K] x scale [N, G] (G = 1, or one per `block` columns) -> [N, K] in dtype."""
    if scale.shape[1] == 1:
        return (codes.float() * scale).to(dtype)
    assert block is not None
    expanded = scale.repeat_interleave(block, dim=1)[:, :codes.shape[1]]
    return (codes.float() * expanded).to(dtype)
