"""x [M, K] (bf16/fp16) @ W.T with W held as FP8 codes [N, K] and scales [N, G], in Triton.

The weight tile is loaded as FP8 (half the bytes of bf16), converted in registers (every FP8
value is exact in bf16) and multiplied on the bf16 tensor cores; scales apply per output row,
once at the end (G = 1: per-tensor / per-channel) or per K group of GROUP_K columns (block
scales: each BLOCK_K step lies in one group, so its partial product is scaled before it is
added). Decode batches are bound by reading the weights, which this halves; large per-channel
batches may instead go to `torch._scaled_mm` with activations quantised per token (FP8 tensor
cores), see `fp8_weight_matmul`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.core.triton_pdl import pdl_launch_args, pdl_prologue
from radixserve.layers.kernels.gemv import fp8_gemv

SCALED_MM_MIN_TOKENS = 256  # per-channel weights at this many rows and more: FP8 tensor cores
FP8_MAX = 448.0


@triton.jit
def _fp8_weight_gemm_kernel(X, W, Scale, B, Y, M, N, K, k_per_split, stride_xm, stride_wn,
                            stride_sn, stride_ym, HAS_BIAS: tl.constexpr,
                            GROUPED: tl.constexpr, GROUP_K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                            USE_PDL: tl.constexpr):
    """SPLIT_K > 1: program_id(2) takes K columns [s * k_per_split, (s + 1) * k_per_split)
    and adds its scaled partial product into the float32 Y with atomics (bias added by the
    caller); few output tiles (small M) then still give every SM work."""
    pdl_prologue(USE_PDL)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    k_begin = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + k_begin + offs_k[None, :]
    w_ptrs = W + offs_n[None, :].to(tl.int64) * stride_wn + k_begin + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k_start
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0,
                    eviction_policy="evict_first")
        part = tl.dot(x, w.to(x.dtype))
        if GROUPED:
            s = tl.load(Scale + offs_n * stride_sn + k_start // GROUP_K, mask=n_mask, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not GROUPED:
        acc = acc * tl.load(Scale + offs_n * stride_sn, mask=n_mask, other=0.0)[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(y_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


TARGET_PROGRAMS = 264  # ~2 per SM on an H200 (132 SMs)


def _config(m: int, n: int, k: int, group_k: int | None) -> dict[str, int]:
    """Small M (decode) is bound by reading the weights: 16/32-row tiles, and K split until
    there are about TARGET_PROGRAMS programs. Not swept yet on the H200 (next session)."""
    if m <= 32:
        cfg = dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=64, BLOCK_K=128, num_warps=4,
                   num_stages=4, SPLIT_K=1)
    elif m <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, SPLIT_K=1)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, SPLIT_K=1)
    if group_k is not None:  # a K step must not straddle two scale groups
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], group_k)
    if m <= 32:
        tiles = triton.cdiv(n, cfg["BLOCK_N"]) * triton.cdiv(m, cfg["BLOCK_M"])
        split = 1
        while tiles * split * 2 <= TARGET_PROGRAMS and k // (split * 2) >= 4 * cfg["BLOCK_K"]:
            split *= 2
        cfg["SPLIT_K"] = split
    return cfg


def fp8_weight_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    group_k: int | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (codes [N, K] x scale [N, G]).T (+ bias) -> [..., N] in x's dtype.
    group_k: the columns per scale group (block size) when G > 1."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    grouped = scale.shape[1] > 1
    cfg = _config(m, n, k, group_k if grouped else None)
    split = cfg["SPLIT_K"]
    # split K: float32 partial sums added with atomics, so the buffer starts at zero
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        k_per_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
        _fp8_weight_gemm_kernel[grid](
            x2, weight, scale, bias if bias is not None else scale, y, m, n, k, k_per_split,
            x2.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, GROUPED=grouped, GROUP_K=group_k or k,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
            SPLIT_K=split, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **pdl_launch_args(x2))
    if split > 1:
        y = (y + bias.float()).to(x.dtype) if bias is not None else y.to(x.dtype)
    return y.view(*x.shape[:-1], n)


def scaled_mm_per_token(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """Activations quantised per token (dynamic), FP8 x FP8 on the tensor cores with row-wise
    scales (cuBLASLt through torch._scaled_mm); per-channel weight scales only."""
    x2 = x.reshape(-1, x.shape[-1])
    x_scale = (x2.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    x_codes = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(weight.dtype)
    y = torch._scaled_mm(x_codes, weight.t(), scale_a=x_scale,
                         scale_b=scale.reshape(1, -1).contiguous(), bias=bias,
                         out_dtype=x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_weight_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      block: int | None, bias: torch.Tensor | None) -> torch.Tensor:
    """The GPU FP8 linear: _scaled_mm for large per-channel batches (when the device has FP8
    tensor cores), else the weight-dequantising Triton GEMM."""
    tokens = x.numel() // x.shape[-1]
    if tokens == 1 and x.is_contiguous():  # batch-1 decode: the FP8 GEMV
        y = fp8_gemv(x.reshape(1, -1), weight, scale, block, bias)
        if y is not None:
            return y.view(*x.shape[:-1], weight.shape[0])
    if (scale.shape[1] == 1 and tokens >= SCALED_MM_MIN_TOKENS and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9):
        return scaled_mm_per_token(x, weight, scale, bias)
    return fp8_weight_gemm(x, weight, scale, block, bias)


def fp8_weight_gemm_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                              group_k: int | None) -> torch.Tensor:
    from radixserve.layers.quantization.fp8 import dequantize_weight
    return x.float() @ dequantize_weight(weight, scale, group_k, torch.float32).t()
