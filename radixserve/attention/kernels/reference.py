"""Plain-PyTorch references for the Triton attention kernels (no Triton needed).

They read the KV pool exactly as the kernels do: through `req_to_token[req_pool_indices[i], pos]`
for cached positions. They loop over requests and compute in float32, so they are slow and
meant for tests and for checking a kernel on a new shape, not for serving.

Options, as in Hugging Face transformers: sliding_window W > 0 lets the query at absolute position
p attend only keys at p - W < j <= p (`masking_utils.sliding_window_overlay`); logit_cap c > 0
turns each score s = (q . k) * sm_scale into c * tanh(s / c) before the softmax (Gemma-2);
sinks [H] (gpt-oss) add each head's logit to its softmax with no value; attention_chunk C > 0
lets the query at p attend only keys of its own chunk, (p // C) * C <= j <= p
(`masking_utils.chunked_overlay`, Llama-4's local layers).
"""
from __future__ import annotations

import torch


def _gather_kv(buffer: torch.Tensor, req_to_token: torch.Tensor, req_slot: int,
               length: int) -> torch.Tensor:
    """[length, kv_heads, head_dim] of one request's cached positions 0..length-1, in float32."""
    slots = req_to_token[req_slot, :length].long()
    return buffer[slots].float()


def _attention_mask(query_pos: torch.Tensor, key_pos: torch.Tensor,
                    sliding_window: int, last_pos: torch.Tensor | None = None,
                    attention_chunk: int = 0) -> torch.Tensor:
    """[Tq, Tk] True = attend: causal (up to `last_pos` where given), within the last
    sliding_window keys (counted from the query) if it is > 0, and within the query's chunk
    if attention_chunk is > 0."""
    last = (query_pos if last_pos is None else last_pos)[:, None]
    query_pos, key_pos = query_pos[:, None], key_pos[None, :]
    mask = key_pos <= last
    if sliding_window > 0:
        mask &= key_pos > query_pos - sliding_window
    if attention_chunk > 0:
        mask &= key_pos // attention_chunk == query_pos // attention_chunk
    return mask


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
            mask: torch.Tensor | None, logit_cap: float = 0.0,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Tq, H, D], k/v: [Tk, Hkv, D] (float32), mask: [Tq, Tk] True = attend. -> [Tq, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    if logit_cap > 0:
        scores = torch.tanh(scores / logit_cap) * logit_cap
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().to(scores.device).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def decode_attention_reference(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                               seq_lens: torch.Tensor, sm_scale: float, *,
                               sliding_window: int = -1, logit_cap: float = 0.0,
                               sinks: torch.Tensor | None = None,
                               attention_chunk: int = 0) -> torch.Tensor:
    """q: [bs, H, D]; every request's query, at position seq_len - 1, attends to its positions
    0..seq_len-1 (only the last sliding_window of them if that is > 0, only those of its chunk
    if attention_chunk is > 0). -> [bs, H, D]."""
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        req_slot, seq_len = int(req_pool_indices[i]), int(seq_lens[i])
        k = _gather_kv(k_buffer, req_to_token, req_slot, seq_len)
        v = _gather_kv(v_buffer, req_to_token, req_slot, seq_len)
        mask = None
        if sliding_window > 0 or attention_chunk > 0:
            mask = _attention_mask(torch.tensor([seq_len - 1]), torch.arange(seq_len),
                                   sliding_window, None, attention_chunk).to(q.device)
        out[i] = _attend(q[i:i + 1].float(), k, v, sm_scale, mask, logit_cap,
                         sinks)[0].to(q.dtype)
    return out


def extend_attention_reference(q: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                               k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                               extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                               sm_scale: float, *, sliding_window: int = -1,
                               logit_cap: float = 0.0,
                               sinks: torch.Tensor | None = None,
                               causal_limit: torch.Tensor | None = None,
                               attention_chunk: int = 0) -> torch.Tensor:
    """q: [T, H, D], k/v_extend: [T, Hkv, D], tokens packed request after request;
    causal_limit [T]: new token i sees new tokens up to its limit (an index among its
    request's new tokens) instead of up to itself.

    Request i's new tokens attend to its cached prefix (positions 0..prefix_len-1, read from the
    pool) and causally to its own new tokens (read from k/v_extend); with sliding_window W > 0
    the new token at position p only to keys p - W < j <= p. -> [T, H, D].
    """
    out = torch.empty_like(q)
    start = 0
    for i in range(len(extend_seq_lens)):
        req_slot = int(req_pool_indices[i])
        prefix_len, ext_len = int(extend_prefix_lens[i]), int(extend_seq_lens[i])
        end = start + ext_len
        k = torch.cat((_gather_kv(k_buffer, req_to_token, req_slot, prefix_len),
                       k_extend[start:end].float()))
        v = torch.cat((_gather_kv(v_buffer, req_to_token, req_slot, prefix_len),
                       v_extend[start:end].float()))
        last = None if causal_limit is None else \
            causal_limit[start:end].cpu().long() + prefix_len
        mask = _attention_mask(torch.arange(prefix_len, prefix_len + ext_len),
                               torch.arange(prefix_len + ext_len), sliding_window,
                               last, attention_chunk).to(q.device)
        out[start:end] = _attend(q[start:end].float(), k, v, sm_scale, mask,
                                 logit_cap, sinks).to(q.dtype)
        start = end
    return out
