"""Gated activations over a merged [T, 2*I] gate|up projection: act(gate) * up."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.cpu_kernels import cpu_ops
from radixserve.layers.quantization.fp8 import FP8_DTYPE, Fp8Rows, quantize_rows


class SiluAndMul(nn.Module):
    """SwiGLU (Llama, Mistral, Qwen)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            try:
                from radixserve.layers.kernels.silu_and_mul import silu_and_mul
                return silu_and_mul(x)
            except ImportError:
                pass
        elif x.dim() == 2 and x.stride(1) == 1 and x.dtype != torch.float64 and \
                x.device.type == "cpu" and cpu_ops() is not None:
            return cpu_ops().silu_and_mul(x)
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]

    def forward_quantized(self, x: torch.Tensor) -> Fp8Rows:
        """silu(gate) * up of x [M, 2I] as per-token e4m3 rows for an FP8 linear: one kernel
        on the GPU; elsewhere `forward` and then the rows quantised (the same values)."""
        if x.is_cuda:
            from radixserve.layers.kernels.silu_and_mul import silu_and_mul_quant
            codes, scales = silu_and_mul_quant(x, FP8_DTYPE)
            return Fp8Rows(codes, scales, x.dtype)
        return quantize_rows(self.forward(x))


class GeluTanhAndMul(nn.Module):
    """GeGLU with the tanh approximation of GELU (Gemma's gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]


class ClampedSwiglu(nn.Module):
    """gpt-oss's experts (vLLM's "swigluoai"): gate clamped above at `limit`, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). The merged projection here
    holds gate then up, as every gated activation of ours takes them (the checkpoint
    interleaves them; the loader splits them)."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(x, self.alpha, self.limit)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2, ungated (Nemotron-H's MLPs and experts: "relu2")."""
    return torch.relu(x).square()


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """ClampedSwiglu over a [..., 2I] gate|up (as transformers' gpt-oss computes it)."""
    half = x.shape[-1] // 2
    gate = x[..., :half].clamp(max=limit)
    up = x[..., half:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul,
                "gelu_tanh": GeluTanhAndMul, "swigluoai": ClampedSwiglu}


def gated_activation(name: str, **options: float) -> nn.Module:
    """The gated activation for a config's hidden_act / hidden_activation (`options`: a
    parametrised one's, e.g. swigluoai's alpha and limit)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported "
                         f"(supported: {', '.join(sorted(_ACTIVATIONS))})")
    return _ACTIVATIONS[name](**options)
