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
full; keys p - W < j <= p for a query at position p) or chunks (`attention_chunk`, None: none;
keys (p // C) * C <= j <= p) and its logit soft-cap (`logit_cap`, 0: none); every backend
honours them.

MLA (DeepSeek-V2, an "mla" pool of latent entries) uses two more entry points:
  * `forward_mla_extend(q, entries, decompress, layer, batch)`: store this pass's latent
    entries, decompress every request's prefix + new entries to per-head K/V with the model's
    `decompress`, and attend (prefix-aware, causal) with `ragged_extend_attention`, which each
    backend implements over the layout of attention/mla_plan.py;
  * `forward_mla_decode(q, entries, layer, batch)`: store, then attend with the absorbed query
    ([bs, H, latent + rope]) over the latent entries (MQA, the latent as value); returns
    [bs, H, latent]. CUDA graphs capture it like `forward_decode`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from typing import Callable

import torch

from radixserve.attention.mla_plan import MLAExtendPlan, build_mla_extend_plan
from radixserve.core.forward_batch import ForwardBatch
from radixserve.mem.kv_pool import KVPool, KVStoreTarget, dequantize
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
    v_head_dim: int | None = None  # the output's head width when not head_dim (MLA: latent)

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def max_context_len(self) -> int:
        return self.req_to_token_pool.max_context_len


Decompress = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class AttentionBackend(ABC):
    def __init__(self, context: AttentionContext) -> None:
        self.context = context
        self.req_to_token_pool = context.req_to_token_pool
        self.kv_pool = context.kv_pool
        self._mla_plan: tuple[ForwardBatch, MLAExtendPlan] | None = None

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build per-pass metadata (index tensors, split plans) from the batch."""

    def kv_store_target(self, layer: "RadixAttention",
                        forward_batch: ForwardBatch) -> "KVStoreTarget | None":
        """Where the pass's producer of q|k|v may rotate and store this layer's K/V itself
        (then `forward(..., kv_stored=True)`), or None: this backend does (the default)."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: "RadixAttention", forward_batch: ForwardBatch,
                rope: "RopeInput | None" = None, kv_stored: bool = False) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, Hkv*D], q/k unrotated when `rope` is given. Returns [T, H*D].
        kv_stored: q is rotated and K/V are in the pool already (`kv_store_target`)."""
        if kv_stored:
            raise NotImplementedError(f"{type(self).__name__} stores K/V itself")
        if rope is not None:
            q, k = rope.rotary(rope.positions, *rope.normed(q, k))
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

    # ---- MLA (latent pools) ----
    def mla_extend_plan(self, forward_batch: ForwardBatch) -> MLAExtendPlan:
        """The pass's prefix layout, built by the first layer that asks."""
        if self._mla_plan is None or self._mla_plan[0] is not forward_batch:
            self._mla_plan = (forward_batch, build_mla_extend_plan(
                forward_batch, self.req_to_token_pool.req_to_token))
        return self._mla_plan[1]

    def forward_mla_extend(self, q: torch.Tensor, entries: torch.Tensor,
                           decompress: Decompress, layer: "RadixAttention",
                           forward_batch: ForwardBatch) -> torch.Tensor:
        """q: [T, H, Dqk] rotated; entries: [T, latent + rope] of the pass's tokens;
        decompress(entries [N, ...]) -> (k [N, H, Dqk], v [N, H, Dv]). Returns [T, H, Dv]."""
        self.kv_pool.store_kv(layer.layer_id, forward_batch.out_cache_loc, entries)
        plan = self.mla_extend_plan(forward_batch)
        if plan.num_prefix_tokens:
            buffer = self.kv_pool.kv_buffers(layer.layer_id)[0]
            prefix = buffer.index_select(0, plan.prefix_slots).view(plan.num_prefix_tokens, -1)
            scales = self.kv_pool.kv_scales(layer.layer_id)
            prefix = prefix.to(entries.dtype) if scales is None else \
                dequantize(prefix, scales[0], entries.dtype)
            entries = torch.cat((prefix, entries))
        k, v = decompress(entries)
        return self.ragged_extend_attention(q, k, v, plan, layer, forward_batch)

    def ragged_extend_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                plan: MLAExtendPlan, layer: "RadixAttention",
                                forward_batch: ForwardBatch) -> torch.Tensor:
        """Causal attention of the new tokens (q [T, H, Dqk]) over k/v ([P + T, H, D]) laid out
        as mla_plan.py describes. Returns [T, H, Dv]."""
        raise NotImplementedError(f"{type(self).__name__} does not serve MLA models")

    def forward_mla_decode(self, q: torch.Tensor, entries: torch.Tensor,
                           layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        """q: [bs, H, latent + rope] absorbed; entries: [bs, latent + rope] to store.
        Returns [bs, H, latent]."""
        raise NotImplementedError(f"{type(self).__name__} does not serve MLA models")

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
