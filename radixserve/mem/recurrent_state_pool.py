"""RecurrentStatePool: the per-request state of linear-attention layers (hybrid models).

A linear-attention layer (Qwen3-Next's and Qwen3.5's Gated DeltaNet) keeps no KV per token: it
carries, per request, the last `conv_width` inputs of its causal convolution and one recurrent
state of [heads, key_dim, value_dim]. Both are rewritten by every pass, so they cannot be shared
between requests the way KV slots are.

The pool has one row per ReqToTokenPool row, with the same index (`req_pool_idx`), plus the
padding row (`size`) that padded CUDA-graph requests point at. A request's states therefore live
exactly as long as its table row: nothing is allocated or freed for them. A pass that extends a
request from position 0 (`extend_prefix_len == 0`) starts from zero states and overwrites
whatever the row held before; any later pass (the next prefill chunk, a decode step) continues
from the row. A request admitted on top of a cached prefix gets that prefix's states copied
into its row before its first pass (`copy_rows`).

Past the padding row lie `snapshots` rows, `snapshot_rows()`, that the prefix cache hands out
itself (mem/hybrid_radix_cache.py): copies of a request's states at the end of a cached prefix.

Layout, per linear-attention layer i (`layer(i)`), rows = size + 1 + snapshots:
  conv[i]:  [rows, conv_width, channels]  the previous inputs, oldest first (model dtype)
  ssm[i]:   [rows, heads, key_dim, value_dim]  the recurrent state (float32)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class RecurrentStateSpec:
    """What one request's states take in one rank's linear-attention layers."""
    num_layers: int
    conv_channels: int  # this rank's channels of the convolution (q | k | v)
    conv_width: int  # inputs kept: the kernel size - 1
    num_heads: int  # this rank's value heads
    key_dim: int
    value_dim: int
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype = torch.float32

    def bytes_per_row(self) -> int:
        conv = self.conv_width * self.conv_channels * self.conv_dtype.itemsize
        ssm = self.num_heads * self.key_dim * self.value_dim * self.ssm_dtype.itemsize
        return self.num_layers * (conv + ssm)


class LayerStates(NamedTuple):
    conv: torch.Tensor  # [rows + 1, conv_width, channels]
    ssm: torch.Tensor  # [rows + 1, heads, key_dim, value_dim]


class RecurrentStatePool:
    def __init__(self, spec: RecurrentStateSpec, size: int, device: str | torch.device,
                 snapshots: int = 0) -> None:
        """`size`: the ReqToTokenPool's rows (its padding row, `size`, gets states too);
        `snapshots`: rows for the prefix cache."""
        self.spec = spec
        self.size = size
        self.snapshots = snapshots
        self.device = torch.device(device)
        rows = size + 1 + snapshots
        self.conv = torch.zeros((spec.num_layers, rows, spec.conv_width, spec.conv_channels),
                                dtype=spec.conv_dtype, device=self.device)
        self.ssm = torch.zeros((spec.num_layers, rows, spec.num_heads, spec.key_dim,
                                spec.value_dim), dtype=spec.ssm_dtype, device=self.device)

    def layer(self, index: int) -> LayerStates:
        return LayerStates(self.conv[index], self.ssm[index])

    def snapshot_rows(self) -> range:
        return range(self.size + 1, self.size + 1 + self.snapshots)

    def copy_rows(self, sources: list[int], targets: list[int]) -> None:
        """Every layer's states of row sources[i] into row targets[i], queued on the device
        behind the passes launched so far (no sync)."""
        if not sources:
            return
        src = torch.tensor(sources, dtype=torch.int64).to(self.device, non_blocking=True)
        dst = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
        for layer in range(self.spec.num_layers):  # one layer's rows at a time in flight
            self.conv[layer].index_copy_(0, dst, self.conv[layer].index_select(0, src))
            self.ssm[layer].index_copy_(0, dst, self.ssm[layer].index_select(0, src))

    def memory_bytes(self) -> int:
        return (self.size + 1 + self.snapshots) * self.spec.bytes_per_row()
