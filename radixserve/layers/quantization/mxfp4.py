"""MXFP4 (OCP microscaling FP4), as gpt-oss ships its experts: per weight row, blocks of 32
values, each an e2m1 code (two per byte, the low nibble first) times the block's power of two
(one uint8 exponent, biased by 127). Dequantised once at load; the experts then run as bf16
(or FP8 with --quantization fp8)."""
from __future__ import annotations

import torch

# the 16 e2m1 codes: sign bit 3, then 2 exponent bits and 1 mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in `dtype` (exact:
    every e2m1 value times a power of two is a bf16 / float32 number unless the exponent
    leaves their range)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)} (blocks of {BLOCK} values, 16 bytes each)")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()
    values = table[codes]  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (blocks [..., K / 32, 16] uint8, scales [..., K / 32] uint8): each block's
    exponent the smallest that fits its largest magnitude in e2m1's 6, each value rounded to
    the nearest code. For tests and tools (checkpoints are quantised elsewhere)."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"the last dim {weight.shape[-1]} is not a multiple of {BLOCK}")
    groups = weight.float().unflatten(-1, (-1, BLOCK))
    amax = groups.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exponents = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=weight.device)
    nearest = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = (nearest | ((scaled < 0).long() << 3)).to(torch.uint8)
    pairs = codes.unflatten(-1, (-1, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponents + SCALE_BIAS).to(torch.uint8)
