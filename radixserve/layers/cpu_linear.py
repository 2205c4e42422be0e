"""x @ W.T on CPU: the compiled GEMV for decode-sized products, oneDNN with W packed once for
the rest, and weights kept in their checkpoint's bf16/fp16 under float32 compute.

`F.linear` on CPU hands a plain weight to oneDNN (bf16) or MKL (fp32), which re-layout the
weight for their kernels inside every call; packing it once into oneDNN's blocked layout and
calling `mkldnn._linear_pointwise` skips that: on a 2-core AVX-512 machine, SmolLM2 shapes run
~2.8x faster at one row (decode, batch 1) and 1.3x (bf16) to 1.8x (fp32) at 64 rows. bf16
results are bit-identical to F.linear; fp32 ones differ in the last bits (another summation
order), as between any two BLAS libraries. The packed copy is cached on the Parameter (keyed by
its storage and version, so a weight that is reloaded or edited in place is packed again) and
costs one more copy of each linear weight in memory. RADIXSERVE_CPU_PREPACK=0 turns it off.

One to four rows (decode at small batch) go to the GEMV of the CPU kernels instead
(core/cpu_kernels: `gemv`), which streams the plain weight rows at memory bandwidth: on a 2-core
AVX2 EPYC, SmolLM2's fp32 linears of one decode step take ~34 ms there against ~51 ms through
oneDNN's packed fp32 (whose small-M kernels read 8-15 GB/s where the GEMV reads 14-19). It
serves fp32 always, and bf16/fp16 where oneDNN has no native kernels for them (emulated bf16 ran
these shapes ~7x slower than fp32). RADIXSERVE_CPU_GEMV=0 turns it off. Larger bf16/fp16
products on such a CPU run in float32 over a packed float32 copy of the weight and are rounded
once to the activations' dtype: the numerics of a native kernel (exact products, float32 sums,
one rounding) at float32 speed.

`keep_checkpoint_dtype(model, dtype)`: where a bf16/fp16 checkpoint is computed in float32 (a
CPU without native bf16/fp16 matmuls, config.resolve_dtype), the linear and embedding weights
whose values the narrow dtype holds exactly go back to it. The GEMV then reads half the bytes
per decode step, and the packed float32 copy for larger products is made from them: the same
float32 values as before, so outputs are unchanged bit for bit, in 6 bytes per weight instead of
8.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from radixserve.config import cpu_computes_natively
from radixserve.core.cpu_kernels import cpu_ops

logger = logging.getLogger(__name__)

_ENABLED = os.environ.get("RADIXSERVE_CPU_PREPACK", "1") != "0"
_GEMV_ENABLED = os.environ.get("RADIXSERVE_CPU_GEMV", "1") != "0"
GEMV_MAX_ROWS = 4  # the kernel's limit; at 4 rows it still matched or beat oneDNN
_DTYPES = (torch.float32, torch.bfloat16)
_NARROW = (torch.bfloat16, torch.float16)
_supported: dict[torch.dtype, bool] = {}


def _dtype_supported(dtype: torch.dtype) -> bool:
    """oneDNN is there and runs `dtype` natively on this CPU (cached: asked on every product)."""
    found = _supported.get(dtype)
    if found is None:
        found = torch.backends.mkldnn.is_available() and cpu_computes_natively(dtype)
        _supported[dtype] = found
    return found


def _weight_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The weight has x's dtype, or is a bf16/fp16 weight under float32 activations."""
    return weight.dtype == x.dtype or (x.dtype == torch.float32 and weight.dtype in _NARROW)


def _packed(weight: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
    key = (weight.data_ptr(), weight._version, dtype)
    cached = getattr(weight, "_radixserve_packed", None)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, torch.ops.mkldnn._reorder_linear_weight(
                weight.detach().to(dtype), None))
        weight._radixserve_packed = cached
    return cached[1]


def _gemv_applies(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The 1-4-row kernel serves this product (shapes and dtypes already checked)."""
    return (_GEMV_ENABLED and 1 <= x2d.shape[0] <= GEMV_MAX_ROWS and weight.stride(1) == 1
            and (x2d.dtype == torch.float32 or not _dtype_supported(x2d.dtype))
            and (bias is None or bias.is_contiguous()) and cpu_ops() is not None)


def packed_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ weight.T (+ bias) through the GEMV kernel (1-4 rows) or the packed weight, or None
    where neither applies (not a CPU Parameter, another dtype, no oneDNN): the caller then runs
    F.linear."""
    if not (x.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 2
            and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
            and x.dtype in _DTYPES + _NARROW and _weight_fits(x, weight)
            and (bias is None or bias.dtype == x.dtype)):
        return None
    flat = x.dim() == 2  # the usual case: no reshape and view (a few us each, per product)
    x2d = x if flat else x.reshape(-1, x.shape[-1])
    if _gemv_applies(x2d, weight, bias):
        out = cpu_ops().gemv(x2d, weight, bias)
        return out if flat else out.view(*x.shape[:-1], weight.shape[0])
    if not (_ENABLED and isinstance(weight, nn.Parameter) and weight.is_contiguous()
            and torch.backends.mkldnn.is_available()):
        return None
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    if x.dtype in _DTYPES and _dtype_supported(x.dtype):
        out = torch.ops.mkldnn._linear_pointwise(x2d, _packed(weight, x.dtype), bias, "none", [],
                                                 "")
    else:
        # bf16/fp16 without native kernels: the product in float32 over a packed float32 copy,
        # rounded once, as a native kernel rounds its float32 sums (exact products of the
        # narrow values, another summation order) at float32 speed, not emulated speed
        out = torch.ops.mkldnn._linear_pointwise(
            x2d.float(), _packed(weight, torch.float32), None if bias is None else bias.float(),
            "none", [], "").to(x.dtype)
    return out if flat else out.view(*x.shape[:-1], weight.shape[0])


def keep_checkpoint_dtype(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the weights of the model's linears and embeddings in `dtype` (bf16/fp16) where it
    holds their float32 values exactly; returns the bytes saved. Modules whose weights other
    code reads directly say so with `weight_read_directly = True` and are left alone, as are
    FP8 layers and weights that `dtype` would round (a GGUF's dequantised values)."""
    from radixserve.layers.embedding import VocabParallelEmbedding
    from radixserve.layers.linear import LinearBase
    if dtype not in _NARROW:
        return 0
    saved = 0
    for module in model.modules():
        linear = isinstance(module, LinearBase) and getattr(module, "fp8", None) is None \
            and getattr(module, "int4", None) is None
        if not (linear or isinstance(module, VocabParallelEmbedding)):
            continue
        if getattr(module, "weight_read_directly", False):
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        narrow = weight.data.to(dtype)
        if not torch.equal(narrow.to(torch.float32), weight.data):
            continue
        saved += weight.numel() * (weight.element_size() - narrow.element_size())
        weight.data = narrow
        if isinstance(module, VocabParallelEmbedding):
            module.output_dtype = torch.float32
    if saved:
        logger.info("linear and embedding weights kept in the checkpoint's %s under float32 "
                    "compute (%.0f MB saved)", str(dtype).removeprefix("torch."), saved / 2**20)
    return saved
