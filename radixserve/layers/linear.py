"""Linear layers with merged projections (q|k|v and gate|up) and shard-aware weight loading.

Single-GPU for now: the 'shards' are the pieces of a merged weight. Tensor parallelism will add a
rank split to the same loaders.
"""
from __future__ import annotations

import functools
import os

import torch
from torch import nn

# RADIXSERVE_GEMV=0 sends one-token products to cuBLAS too (for A/B timing)
_GEMV_ENABLED = os.environ.get("RADIXSERVE_GEMV", "1") != "0"


@functools.lru_cache(maxsize=None)
def _gemv_for(n: int, k: int):  # -> (gemv function, config) or None
    try:
        from radixserve.layers.kernels.gemv import gemv, gemv_config
    except ImportError:  # no triton
        return None
    config = gemv_config(n, k)
    return None if config is None else (gemv, config)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x @ weight.T (+ bias). A single row on CUDA in fp16/bf16 (batch-1 decode) goes to the
    Triton GEMV, which reads the weights faster than cuBLAS does at M=1; the rest to cuBLAS."""
    if (_GEMV_ENABLED and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and weight.stride(1) == 1):
        found = _gemv_for(*weight.shape)
        if found is not None:
            gemv, config = found
            return gemv(x.contiguous(), weight, bias, config)
    return nn.functional.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `linear` (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(nn.Module):
    """y = x @ W.T (+ b) where W stacks several checkpoint weights along the output dim."""

    def __init__(self, input_size: int, output_sizes: list[int], shard_names: list[str],
                 bias: bool = False) -> None:
        super().__init__()
        self.output_sizes = output_sizes
        self.shard_offsets = {}
        offset = 0
        for name, size in zip(shard_names, output_sizes):
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.weight = nn.Parameter(torch.empty(offset, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(offset), requires_grad=False) if bias else None

    def load_shard(self, shard_name: str, param_kind: str, tensor: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard_name]
        target = self.weight if param_kind == "weight" else self.bias
        assert target is not None, f"checkpoint has a {param_kind} the layer lacks"
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard_name}: expected {size} rows, got {tuple(tensor.shape)}")
        target.data[start:start + size].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class QKVLinear(MergedLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q, kv, kv], ["q", "k", "v"], bias)
        self.q_size, self.kv_size = q, kv

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class GateUpLinear(MergedLinear):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__(hidden_size, [intermediate_size, intermediate_size], ["gate", "up"],
                         bias)
