"""The reference backend and the CPU path: gather K/V through req_to_token, then SDPA.

Requests are padded to the longest one in the batch and run as one SDPA call with a mask, so the
cost per layer is a few large ops rather than one small op per request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBackend

if TYPE_CHECKING:
    from radixserve.executor.forward_batch import ForwardBatch
    from radixserve.layers.radix_attention import RadixAttention


@dataclass
class TorchNativeMetadata:
    kv_indices: torch.Tensor  # [bs, max_kv_len] KV slots (0 where padded)
    attn_mask: torch.Tensor  # [bs, 1, max_q_len, max_kv_len] bool, True = attend
    q_scatter: torch.Tensor  # [T] flat index into the padded [bs * max_q_len] query layout
    max_q_len: int


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self) -> None:
        self.metadata: TorchNativeMetadata | None = None

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        device = forward_batch.input_ids.device
        bs = forward_batch.batch_size
        seq_lens = forward_batch.seq_lens
        max_kv_len = max(forward_batch.seq_lens_cpu)
        if forward_batch.forward_mode.is_decode():
            q_lens_cpu = [1] * bs
            q_lens = torch.ones(bs, dtype=torch.int64, device=device)
        else:
            assert forward_batch.extend_seq_lens is not None
            q_lens_cpu = forward_batch.extend_seq_lens_cpu or []
            q_lens = forward_batch.extend_seq_lens
        max_q_len = max(q_lens_cpu)

        rows = forward_batch.req_to_token_pool.req_to_token[forward_batch.req_pool_indices]
        kv_pos = torch.arange(max_kv_len, device=device)
        kv_valid = kv_pos[None, :] < seq_lens[:, None]
        kv_indices = torch.where(kv_valid, rows[:, :max_kv_len].to(torch.int64), 0)

        # query i of request b sits at absolute position prefix_len + i = seq_len - q_len + i
        q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q_len, device=device)[None, :]
        causal = kv_pos[None, None, :] <= q_pos[:, :, None]
        # every row, padded ones included, may see position 0, so softmax stays finite
        mask = causal & kv_valid[:, None, :]

        q_valid = torch.arange(max_q_len, device=device)[None, :] < q_lens[:, None]
        flat = torch.arange(bs * max_q_len, device=device).view(bs, max_q_len)
        self.metadata = TorchNativeMetadata(kv_indices, mask[:, None], flat[q_valid], max_q_len)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        meta = self.metadata
        assert meta is not None
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc,
                           k.view(-1, layer.tp_k_head_num, layer.head_dim),
                           v.view(-1, layer.tp_v_head_num, layer.head_dim))
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        bs, num_heads, head_dim = forward_batch.batch_size, layer.tp_q_head_num, layer.head_dim
        # [bs, H, max_q_len, D]
        q_pad = q.new_zeros(bs * meta.max_q_len, num_heads, head_dim)
        q_pad[meta.q_scatter] = q.view(-1, num_heads, head_dim)
        q_pad = q_pad.view(bs, meta.max_q_len, num_heads, head_dim).transpose(1, 2)
        keys = k_buf[meta.kv_indices].transpose(1, 2).to(q.dtype)  # [bs, Hkv, L, D]
        values = v_buf[meta.kv_indices].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=meta.attn_mask,
                                             scale=layer.scaling,
                                             enable_gqa=layer.tp_k_head_num != num_heads)
        out = out.transpose(1, 2).reshape(bs * meta.max_q_len, num_heads * head_dim)
        return out[meta.q_scatter]

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        """One query per request: two batched matmuls over the query heads of each KV head
        (on CPU several times faster than SDPA with a mask, in bf16 about ten times)."""
        meta = self.metadata
        assert meta is not None
        pool = forward_batch.token_to_kv_pool
        num_kv_heads, head_dim = layer.tp_k_head_num, layer.head_dim
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc,
                           k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim))
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        bs = forward_batch.batch_size
        group = layer.tp_q_head_num // num_kv_heads
        keys = k_buf[meta.kv_indices].permute(0, 2, 3, 1).to(q.dtype)  # [bs, Hkv, D, L]
        values = v_buf[meta.kv_indices].transpose(1, 2).to(q.dtype)  # [bs, Hkv, L, D]
        q_grouped = q.view(bs, num_kv_heads, group, head_dim)
        scores = torch.matmul(q_grouped, keys).float() * layer.scaling  # [bs, Hkv, G, L]
        scores.masked_fill_(~meta.attn_mask.view(bs, 1, 1, -1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, values).reshape(bs, layer.tp_q_head_num * head_dim)
