"""The attention backend interface.

A backend computes attention for one layer over the token-granular KV pool. Each backend keeps its
own metadata object, built once per forward pass by `init_forward_metadata` and read by every
layer. `forward` applies rope to q and k when given one (a `RopeInput`: positions and the rotary
module), stores this pass's K/V (K rotated) into the pool at `forward_batch.out_cache_loc` and
then attends; it returns [num_tokens, num_heads * head_dim]. The default `forward` rotates with
`rope.rotary(positions, q, k)` and then calls `forward_decode` / `forward_extend`, which store
and attend; a backend may override it to fuse the rotation with its store (the Triton backend
does). q and k may be rotated in place.

CUDA graph support (decode only): `init_cuda_graph_state(max_bs)` allocates fixed buffers;
`init_forward_metadata_capture_cuda_graph` points the metadata at them for a capture of `bs`
requests; `init_forward_metadata_replay_cuda_graph` fills them in place before a replay.
Padding requests of a replay have seq_len `get_cuda_graph_seq_len_fill_value()`, req_pool_index 0
and out_cache_loc 0: their KV writes land in slot 0, the padding sink, and their outputs are dropped.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.executor.forward_batch import ForwardBatch
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.layers.rotary import RopeInput


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Build per-pass metadata (index tensors, split plans) from the batch."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: "RadixAttention", forward_batch: "ForwardBatch",
                rope: "RopeInput | None" = None) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, Hkv*D], q/k unrotated when `rope` is given. Returns [T, H*D]."""
        if rope is not None:
            q, k = rope.rotary(rope.positions, q, k)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        """New tokens attend to their cached prefix and causally to each other."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        """One new token per request attends to the whole sequence."""

    # ---- CUDA graphs (decode) ----
    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        raise NotImplementedError

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int) -> None:
        raise NotImplementedError

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1
