"""SiLU(gate) * up over a merged [T, 2*I] projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            try:
                from radixserve.layers.kernels.silu_and_mul import silu_and_mul
                return silu_and_mul(x)
            except ImportError:
                pass
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]
