"""The reference backend and the CPU path: gather K/V through req_to_token, then attend.

Requests are padded to the longest one of their kind and run as a few large ops per layer:
prefill parts through SDPA with a causal mask over the cached prefix, single-token (decode)
parts as one SDPA call per part with each KV head's query group as the query length. A MIXED
batch splits into its extend head and its decode tail, so one long chunk does not pad every
decode request to the chunk's length.

A layer's attention window narrows the mask (keys p - W < j <= p), and so do its attention
chunks (keys (p // C) * C <= j <= p); masks are built once per pass for each distinct window
or chunk size. A layer with a logit soft-cap (Gemma-2) runs the scores through
explicit matmuls, since SDPA cannot cap them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBackend, AttentionContext
from radixserve.attention.mla_plan import MLAExtendPlan
from radixserve.core.forward_batch import ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import dequantize

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention


@dataclass
class PaddedPart:
    """A run of requests whose tokens are [token_start, token_end) of the pass."""
    token_start: int
    token_end: int
    kv_indices: torch.Tensor  # [bs, max_kv_len] KV slots (0 where padded)
    attn_mask: torch.Tensor  # [bs, 1, max_q_len, max_kv_len] bool, True = attend (no window)
    q_scatter: torch.Tensor  # [T] flat index into the padded [bs * max_q_len] query layout
    max_q_len: int
    q_pos: torch.Tensor  # [bs, max_q_len] absolute position of each (padded) query
    q_valid: torch.Tensor  # [bs, max_q_len] False on padding rows
    # ("window", W) or ("chunk", C) -> attn_mask narrowed to it
    window_masks: dict[tuple[str, int], torch.Tensor]

    @property
    def batch_size(self) -> int:
        return int(self.kv_indices.shape[0])

    def mask(self, sliding_window: int | None,
             attention_chunk: int | None = None) -> torch.Tensor:
        """The mask of a layer with this window or these chunks (None: full causal)."""
        max_kv_len = self.kv_indices.shape[1]
        if attention_chunk:
            key = ("chunk", attention_chunk)
        elif sliding_window and sliding_window < max_kv_len:
            key = ("window", sliding_window)
        else:
            return self.attn_mask
        found = self.window_masks.get(key)
        if found is None:
            kv_pos = torch.arange(max_kv_len, device=self.q_pos.device)[None, None, :]
            q_pos = self.q_pos[:, :, None]
            if attention_chunk:  # keys of the query's own chunk
                in_window = kv_pos >= torch.div(q_pos, attention_chunk,
                                                rounding_mode="floor") * attention_chunk
            else:
                in_window = kv_pos > q_pos - sliding_window
            # padding rows keep position 0 only, so their softmax stays finite
            in_window |= ~self.q_valid[:, :, None]
            found = self.attn_mask & in_window[:, None]
            self.window_masks[key] = found
        return found


def _build_part(forward_batch: ForwardBatch, req_to_token: torch.Tensor, req_start: int,
                req_end: int, token_start: int, q_lens_cpu: list[int]) -> PaddedPart:
    device = forward_batch.input_ids.device
    seq_lens = forward_batch.seq_lens[req_start:req_end]
    max_kv_len = max(forward_batch.seq_lens_cpu[req_start:req_end])
    max_q_len = max(q_lens_cpu)
    q_lens = torch.tensor(q_lens_cpu, dtype=torch.int64, device=device)
    rows = req_to_token[forward_batch.req_pool_indices[req_start:req_end]]
    kv_pos = torch.arange(max_kv_len, device=device)
    kv_valid = kv_pos[None, :] < seq_lens[:, None]
    kv_indices = torch.where(kv_valid, rows[:, :max_kv_len].to(torch.int64), 0)
    # query i of a request sits at absolute position prefix_len + i = seq_len - q_len + i
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q_len, device=device)[None, :]
    q_valid = torch.arange(max_q_len, device=device)[None, :] < q_lens[:, None]
    flat = torch.arange(len(q_lens_cpu) * max_q_len, device=device).view(-1, max_q_len)
    # the last position each query sees: its own, or past it (ForwardBatch.extend_causal_limit)
    q_last = q_pos
    limits = forward_batch.extend_causal_limit
    if limits is not None and max_q_len > 1:
        own = torch.arange(max_q_len, device=device)[None, :].expand(len(q_lens_cpu), -1)
        q_last = q_pos.clone()
        q_last.view(-1)[flat[q_valid]] += \
            limits[token_start:token_start + sum(q_lens_cpu)].to(torch.int64) - own[q_valid]
    # every row, padded ones included, may see position 0, so softmax stays finite
    mask = (kv_pos[None, None, :] <= q_last[:, :, None]) & kv_valid[:, None, :]
    return PaddedPart(token_start, token_start + sum(q_lens_cpu), kv_indices, mask[:, None],
                      flat[q_valid], max_q_len, q_pos, q_valid, {})


def _explicit_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        mask: torch.Tensor, scaling: float, cap: float,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scaling / cap) masked) v, as Gemma-2's eager attention (no
    cap where it is 0); with `sinks` (broadcast to [bs, H, Lq, 1]) each row's softmax also
    takes its head's sink logit, whose weight is then dropped, as gpt-oss's eager attention.
    q: [bs, H, Lq, D], keys/values: [bs, Hkv, L, D] (query heads grouped per KV head)."""
    group = q.shape[1] // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scaling
    if cap > 0:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1,
                              dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), values)


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, context: AttentionContext) -> None:
        super().__init__(context)
        self.parts: list[PaddedPart] = []

    def _part(self, forward_batch: ForwardBatch, req_start: int, req_end: int,
              token_start: int, q_lens_cpu: list[int]) -> PaddedPart:
        return _build_part(forward_batch, self.req_to_token_pool.req_to_token, req_start,
                           req_end, token_start, q_lens_cpu)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        bs = forward_batch.batch_size
        if forward_batch.forward_mode.is_decode():
            self.parts = [self._part(forward_batch, 0, bs, 0, [1] * bs)]
            return
        q_lens = forward_batch.extend_seq_lens_cpu or []
        # the decode tail of a MIXED batch (requests with one new token)
        split = bs
        if forward_batch.forward_mode is ForwardMode.MIXED:
            while split > 1 and q_lens[split - 1] == 1:
                split -= 1
        if split == bs:
            self.parts = [self._part(forward_batch, 0, bs, 0, q_lens)]
            return
        head_tokens = sum(q_lens[:split])
        self.parts = [self._part(forward_batch, 0, split, 0, q_lens[:split]),
                      self._part(forward_batch, split, bs, head_tokens, q_lens[split:])]

    @staticmethod
    def _gather(buffer: torch.Tensor, part: PaddedPart, dtype: torch.dtype,
                scale: float | None = None) -> torch.Tensor:
        """[bs, max_kv_len, heads, head_dim] rows of one layer's K or V buffer (index_select
        is several times faster than advanced indexing on CPU), dequantised when `scale` is
        given (FP8 storage)."""
        bs, max_kv_len = part.kv_indices.shape
        rows = buffer.index_select(0, part.kv_indices.reshape(-1))
        rows = rows.view(bs, max_kv_len, *buffer.shape[1:])
        return rows.to(dtype) if scale is None else dequantize(rows, scale, dtype)

    def _scales(self, layer_id: int) -> tuple[float | None, float | None]:
        scales = self.kv_pool.kv_scales(layer_id)
        return (None, None) if scales is None else scales

    def _attend_padded(self, q: torch.Tensor, part: PaddedPart,
                       layer: "RadixAttention") -> torch.Tensor:
        k_buf, v_buf = self.kv_pool.kv_buffers(layer.layer_id)
        k_scale, v_scale = self._scales(layer.layer_id)
        bs, num_heads, head_dim = part.batch_size, layer.tp_q_head_num, layer.head_dim
        q_pad = q.new_zeros(bs * part.max_q_len, num_heads, head_dim)
        q_pad[part.q_scatter] = q.view(-1, num_heads, head_dim)
        q_pad = q_pad.view(bs, part.max_q_len, num_heads, head_dim).transpose(1, 2)
        keys = self._gather(k_buf, part, q.dtype, k_scale).transpose(1, 2)  # [bs, Hkv, L, D]
        values = self._gather(v_buf, part, q.dtype, v_scale).transpose(1, 2)
        mask = part.mask(layer.sliding_window, layer.attention_chunk)
        if layer.logit_cap > 0 or layer.sinks is not None:
            sinks = None if layer.sinks is None else layer.sinks.view(1, num_heads, 1, 1)
            out = _explicit_attention(q_pad, keys, values, mask, layer.scaling,
                                      layer.logit_cap, sinks)
        else:
            out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=mask,
                                                 scale=layer.scaling,
                                                 enable_gqa=layer.tp_k_head_num != num_heads)
        out = out.transpose(1, 2).reshape(bs * part.max_q_len, num_heads * head_dim)
        return out[part.q_scatter]

    def _attend_single_token(self, q: torch.Tensor, part: PaddedPart,
                             layer: "RadixAttention") -> torch.Tensor:
        """One token per request: each KV head's group of query heads becomes the query length
        of one SDPA call over (request, KV head) pairs, so K/V are used as gathered (no GQA
        expansion, no permuted copies); ~2x faster on CPU than two bmm's over permuted copies."""
        k_buf, v_buf = self.kv_pool.kv_buffers(layer.layer_id)
        k_scale, v_scale = self._scales(layer.layer_id)
        bs, num_kv_heads, head_dim = part.batch_size, layer.tp_k_head_num, layer.head_dim
        group = layer.tp_q_head_num // num_kv_heads
        keys = self._gather(k_buf, part, q.dtype, k_scale).transpose(1, 2)  # [bs, Hkv, L, D]
        values = self._gather(v_buf, part, q.dtype, v_scale).transpose(1, 2)
        # query head h uses KV head h // group: [bs, Hkv, group, D]
        grouped_q = q.reshape(bs, num_kv_heads, group, head_dim)
        mask = part.mask(layer.sliding_window, layer.attention_chunk).view(bs, 1, 1, -1)
        if layer.logit_cap > 0 or layer.sinks is not None:
            sinks = None if layer.sinks is None else layer.sinks.view(1, num_kv_heads, group, 1)
            out = _explicit_attention(grouped_q, keys, values, mask, layer.scaling,
                                      layer.logit_cap, sinks)
        else:
            out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask,
                                                 scale=layer.scaling)
        return out.reshape(bs, layer.tp_q_head_num * head_dim)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        self.kv_pool.store_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        outs = []
        for part in self.parts:
            q_part = q[part.token_start:part.token_end]
            if part.max_q_len == 1:
                outs.append(self._attend_single_token(q_part, part, layer))
            else:
                outs.append(self._attend_padded(q_part, part, layer))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch)

    # ---- MLA ----
    def ragged_extend_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                plan: MLAExtendPlan, layer: "RadixAttention",
                                forward_batch: ForwardBatch) -> torch.Tensor:
        """One SDPA per request over its prefix rows and its new rows (CPU path)."""
        outs = []
        prefix_start, token_start = 0, 0
        new_rows = plan.num_prefix_tokens
        for prefix_len, ext_len in zip(plan.prefix_lens_cpu, plan.extend_lens_cpu):
            rows = torch.cat((torch.arange(prefix_start, prefix_start + prefix_len),
                              torch.arange(new_rows + token_start,
                                           new_rows + token_start + ext_len))).to(k.device)
            keys = k.index_select(0, rows).transpose(0, 1)  # [H, L, D]
            values = v.index_select(0, rows).transpose(0, 1)
            query = q[token_start:token_start + ext_len].transpose(0, 1)
            q_pos = torch.arange(ext_len, device=q.device)[:, None] + prefix_len
            mask = torch.arange(prefix_len + ext_len, device=q.device)[None, :] <= q_pos
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                 scale=layer.scaling)
            outs.append(out.transpose(0, 1))
            prefix_start += prefix_len
            token_start += ext_len
        return torch.cat(outs)

    def forward_mla_decode(self, q: torch.Tensor, entries: torch.Tensor,
                           layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        """All heads share the one latent entry per position (MQA): the heads become the query
        length of one SDPA per request; the latent's first v_head_dim values are the value."""
        self.kv_pool.store_kv(layer.layer_id, forward_batch.out_cache_loc, entries)
        part = self.parts[0]
        (buffer,) = self.kv_pool.kv_buffers(layer.layer_id)
        keys = self._gather(buffer, part, q.dtype,
                            self._scales(layer.layer_id)[0]).transpose(1, 2)  # [bs, 1, L, D]
        values = keys[..., :layer.v_head_dim]
        mask = part.mask(None).view(part.batch_size, 1, 1, -1)
        out = F.scaled_dot_product_attention(q.unsqueeze(1), keys, values, attn_mask=mask,
                                             scale=layer.scaling)
        return out.squeeze(1)
