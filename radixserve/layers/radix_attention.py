"""The attention layer the models call: shapes only, computation goes to the backend.

Models pass q, k, v straight from the projection and the rope as a `RopeInput`; the backend
rotates q/k (fused with its KV-cache store where it can) before attending.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.rotary import RopeInput

if TYPE_CHECKING:
    from radixserve.executor.forward_batch import ForwardBatch

__all__ = ["RadixAttention", "RopeInput"]


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int,
                 layer_id: int) -> None:
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                forward_batch: "ForwardBatch", rope: RopeInput | None = None) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hkv*D], unrotated when `rope` is given. Returns [T, Hq*D]."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, rope)
