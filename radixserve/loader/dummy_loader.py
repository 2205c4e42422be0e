"""Random weights for shape-only runs (`--load-format dummy`), like SGLang's dummy format.

Every floating-point parameter gets U(-1e-3, 1e-3), except norm weights (parameters whose name
contains "norm"), which get 1 + U(-1e-3, 1e-3): RMSNorm then passes activations through at
their natural scale instead of shrinking them 1000x per norm, so runs stay numerically sane
(finite logits, no underflow) for any depth. Buffers (rotary tables, ...) are left alone.

FP8 weights (`--load-format dummy` of an FP8 checkpoint) get codes over the FP8 range and
scales of weight_range / 448, so their values fall in the same range. Int4 zero points are
drawn from 0..15 and int4 codes as whole int32 words.

Reproducible: each parameter draws from its own generator seeded from (seed, parameter name), so
the values do not depend on parameter order; they do depend on the device type (CPU and CUDA
generators differ) and on the parameter's shape (a TP shard is not a slice of the full tensor).
"""
from __future__ import annotations

import zlib

import torch

DUMMY_WEIGHT_RANGE = 1e-3
FP8_SLICE_ELEMENTS = 1 << 26  # 256 MB of float32 at a time


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def is_norm_weight(name: str) -> bool:
    return "norm" in name


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int,
                       weight_range: float = DUMMY_WEIGHT_RANGE) -> None:
    """Fill every floating-point parameter of `model` in place (see module docstring)."""
    for name, param in model.named_parameters():
        if param.dtype == torch.uint8 or name.endswith(("qweight", "weight_packed")):
            # int4 zero points (uint8, 0..15) and codes (int32 words of eight)
            generator = torch.Generator(device=param.device)
            generator.manual_seed(_param_seed(seed, name))
            if param.dtype == torch.uint8:
                param.random_(0, 16, generator=generator)
            else:
                param.random_(-2 ** 31, 2 ** 31, generator=generator)
            continue
        if not param.dtype.is_floating_point:
            continue
        generator = torch.Generator(device=param.device)
        generator.manual_seed(_param_seed(seed, name))
        if param.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            # FP8 codes over the format's range; their scales (below) bring them to the range.
            # Drawn in float32 slices of at most FP8_SLICE_ELEMENTS: a stacked expert weight
            # (DeepSeek-V3: 257 x 4096 x 7168) would otherwise need a 30 GB float32 copy,
            # which the caching allocator keeps after it is freed
            fp8_max = torch.finfo(param.dtype).max
            flat = param.view(-1)
            for start in range(0, flat.numel(), FP8_SLICE_ELEMENTS):
                piece = flat[start:start + FP8_SLICE_ELEMENTS]
                codes = torch.empty(piece.shape, device=param.device)
                codes.uniform_(-fp8_max, fp8_max, generator=generator)
                piece.copy_(codes.to(param.dtype))
            continue
        if name.endswith("weight_scale"):
            param.fill_(weight_range / 448.0)
            continue
        param.uniform_(-weight_range, weight_range, generator=generator)
        if is_norm_weight(name):
            param.add_(1.0)
