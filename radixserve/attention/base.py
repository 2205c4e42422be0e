"""The attention backend interface.

Every backend is built the same way, `Backend(context: AttentionContext)`, and looked up by name
in attention/registry.py. A backend computes attention for one layer over the token-granular KV
pool it was given; it writes the pass's K/V through the pool's methods (`store_kv`, or the fused
`rotate_and_store_kv`), never into its buffers directly. Each backend keeps its
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
Padding requests of a replay have seq_len `get_cuda_graph_seq_len_fill_value()`, req_pool_index
`req_to_token_pool.padding_row` (a row no request owns) and out_cache_loc 0: their KV writes land
in slot 0, the padding sink, and their outputs are dropped.

Each layer (a RadixAttention) carries its scaling, its attention window (`sliding_window`, None:
full; keys p - W < j <= p for a query at position p) and its logit soft-cap (`logit_cap`, 0:
none); every backend honours both.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.core.forward_batch import ForwardBatch
from radixserve.mem.kv_pool import KVPool
from radixserve.mem.req_to_token_pool import ReqToTokenPool

if TYPE_CHECKING:  # same layer (layers/ and attention/ sit side by side)
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.layers.rotary import RopeInput


@dataclass
class AttentionContext:
    """What every backend is built from. Head counts are per tensor-parallel rank."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    device: torch.device
    max_bs: int  # the most requests one pass holds (request rows)
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool

    @property
    def max_context_len(self) -> int:
        return self.req_to_token_pool.max_context_len


class AttentionBackend(ABC):
    def __init__(self, context: AttentionContext) -> None:
        self.context = context
        self.req_to_token_pool = context.req_to_token_pool
        self.kv_pool = context.kv_pool

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build per-pass metadata (index tensors, split plans) from the batch."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: "RadixAttention", forward_batch: ForwardBatch,
                rope: "RopeInput | None" = None) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, Hkv*D], q/k unrotated when `rope` is given. Returns [T, H*D]."""
        if rope is not None:
            q, k = rope.rotary(rope.positions, q, k)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        """New tokens attend to their cached prefix and causally to each other."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
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
