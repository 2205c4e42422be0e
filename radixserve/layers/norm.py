"""RMSNorm, computed in fp32 like HF transformers, with an optional fused residual add; and
Gemma's variant, which scales by (1 + weight) in fp32."""
from __future__ import annotations

import torch
from torch import nn

from radixserve.core.cpu_kernels import cpu_ops
from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.quantization.fp8 import FP8_DTYPE, Fp8Rows, quantize_rows


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            fused = _cuda_rmsnorm()
            if fused is not None:
                return fused(x, self.weight, self.variance_epsilon, residual)
        elif _cpu_kernel_fits(x, self.weight, residual):
            out = cpu_ops().rms_norm(x, self.weight, self.variance_epsilon, residual)
            return out[0] if residual is None else (out[0], out[1])
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def forward_quantized(self, x: torch.Tensor, residual: torch.Tensor | None = None
                          ) -> tuple[Fp8Rows, torch.Tensor | None]:
        """(norm(x [+ residual]) as per-token e4m3 rows for an FP8 linear, x + residual or
        None). x [M, hidden] in the weight's dtype. One kernel on the GPU; elsewhere `forward`
        and then the rows quantised (the same values)."""
        if x.is_cuda:
            from radixserve.layers.kernels.rmsnorm import fused_rmsnorm_quant
            codes, scales, residual = fused_rmsnorm_quant(x, self.weight, self.variance_epsilon,
                                                          residual, FP8_DTYPE)
            return Fp8Rows(codes, scales, x.dtype), residual
        out = self.forward(x, residual)
        if residual is not None:
            out, residual = out
        return quantize_rows(out), residual


class LayerNorm(nn.Module):
    """LayerNorm with a weight and a bias over the last dim (PhiMoE's), taking the residual
    as RMSNorm does: with it, (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        out = torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight.to(x.dtype),
                                             self.bias.to(x.dtype), self.variance_epsilon)
        return out if residual is None else (out, residual)


def _cpu_kernel_fits(x: torch.Tensor, weight: torch.Tensor,
                     residual: torch.Tensor | None) -> bool:
    """The compiled CPU kernel (core/cpu_kernels) applies: 2-D rows, one dtype throughout."""
    return x.dim() == 2 and x.device.type == "cpu" and x.stride(1) == 1 and \
        weight.dtype == x.dtype and x.dtype != torch.float64 and \
        (residual is None or (residual.dtype == x.dtype and residual.dim() == 2
                              and residual.stride(1) == 1)) and cpu_ops() is not None


def _cuda_rmsnorm():  # type: ignore[no-untyped-def]
    try:
        from radixserve.layers.kernels.rmsnorm import fused_rmsnorm
    except ImportError:
        return None
    return fused_rmsnorm


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), all in fp32, cast at the end
    (Llama's casts before the weight multiply; the rounding differs). With a residual, as
    RMSNorm: (norm(x + residual), x + residual). One Triton kernel on the GPU."""

    weight_offset = 1.0  # the scale is weight + this, in float32

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            fused = _cuda_rmsnorm()
            if fused is not None:
                return fused(x, self.weight, self.variance_epsilon, residual,
                             weight_offset=self.weight_offset)
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        out = self._scaled(h, h.pow(2).mean(-1, keepdim=True), x.dtype)
        return out if residual is None else (out, residual)

    def _scaled(self, h: torch.Tensor, variance: torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor:
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return (h * (self.weight.float() + self.weight_offset)).to(dtype)


class OlmoRMSNorm(GemmaRMSNorm):
    """OLMo-2's RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)) in fp32, cast at the end (Llama
    casts before the weight): Gemma's without the 1 +. `full_width` (q/k norms over a whole
    projection that tensor parallelism splits): the mean is over that many columns, the ranks'
    sums of squares added by an all-reduce; `replicas` ranks hold each column (KV heads
    replicated over the ranks), counted once. With a residual, as RMSNorm:
    (norm(x + residual), x + residual)."""

    weight_offset = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, full_width: int | None = None,
                 replicas: int = 1) -> None:
        super().__init__(hidden_size, eps)
        self.weight.data.fill_(1.0)
        self.full_width = full_width
        self.replicas = replicas

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.full_width is None:
            return super().forward(x, residual)
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        squares = h.pow(2).sum(-1, keepdim=True)
        group = get_tp_group()
        if group.size > 1:
            squares = group.all_reduce(squares) / self.replicas
        out = self._scaled(h, squares / self.full_width, x.dtype)
        return out if residual is None else (out, residual)


class ProjectionRMSNorm(OlmoRMSNorm):
    """A q/k norm over a whole projection (OlmoRMSNorm's `full_width`, the ranks' sums of
    squares all-reduced) in Llama's rounding: the normed values cast to the input dtype before
    the weight multiplies them (MiniMax-M2)."""

    def _scaled(self, h: torch.Tensor, variance: torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor:
        return self.weight * (h * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)
