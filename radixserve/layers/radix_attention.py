"""The attention layer the models call: shapes only, computation goes to the backend.

Models pass q, k, v straight from the projection and the rope as a `RopeInput`; the backend
rotates q/k (fused with its KV-cache store where it can) before attending. Per layer it carries
what the backends must honour: the scaling, an attention window (`sliding_window`, None: full;
a query at position p sees keys p - W < j <= p, as transformers defines it) or attention chunks
(`attention_chunk`, None: none; a query at p sees only keys of its own chunk of C positions,
(p // C) * C <= j <= p: Llama-4's local layers) and the attention
logit soft-cap (`logit_cap`, 0: none; scores s become cap * tanh(s / cap), Gemma-2), and
per-head attention sinks (`sinks`, None: none; gpt-oss): a learned logit per query head that
joins each row's softmax with no value, so a row's weights sum to less than one.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.layers.rotary import RopeInput
from radixserve.mem.kv_pool import KVStoreTarget

__all__ = ["RadixAttention", "RopeInput"]


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int,
                 layer_id: int, sliding_window: int | None = None,
                 logit_cap: float = 0.0, v_head_dim: int | None = None,
                 attention_chunk: int | None = None) -> None:
        """v_head_dim: the value's (and output's) head width when not head_dim (MLA)."""
        if sliding_window and attention_chunk:
            raise ValueError("a layer has either a sliding window or attention chunks")
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window = sliding_window
        self.attention_chunk = attention_chunk
        self.logit_cap = logit_cap
        self.sinks: torch.Tensor | None = None  # [this rank's query heads] float32, the model's

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                forward_batch: ForwardBatch, rope: RopeInput | None = None,
                kv_stored: bool = False) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hkv*D], unrotated when `rope` is given. Returns [T, Hq*D].
        kv_stored: q is rotated and K/V were stored at `kv_store_target` by their producer."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, rope, kv_stored)

    def kv_store_target(self, forward_batch: ForwardBatch) -> "KVStoreTarget | None":
        """Where this pass's producer of q|k|v may rotate and store K/V itself (None: the
        backend does it in `forward`)."""
        return forward_batch.attn_backend.kv_store_target(self, forward_batch)

    def forward_mla_extend(self, q: torch.Tensor, entries: torch.Tensor,
                           decompress: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                           forward_batch: ForwardBatch) -> torch.Tensor:
        """MLA prefill: see AttentionBackend.forward_mla_extend. Returns [T, H, v_head_dim]."""
        return forward_batch.attn_backend.forward_mla_extend(q, entries, decompress, self,
                                                             forward_batch)

    def forward_mla_decode(self, q: torch.Tensor, entries: torch.Tensor,
                           forward_batch: ForwardBatch) -> torch.Tensor:
        """MLA decode with the absorbed query. Returns [bs, H, v_head_dim] (the latent)."""
        return forward_batch.attn_backend.forward_mla_decode(q, entries, self, forward_batch)
