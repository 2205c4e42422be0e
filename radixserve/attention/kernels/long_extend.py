"""Attention for one long extend run (a long prompt, or a chunk of one over a long cached prefix)
through cuDNN's fused attention, the fastest attention kernel torch ships for Hopper.

On an H200 (bf16, Llama-3.1-8B heads: 32 query, 8 KV, head_dim 128) an 8,192-token chunk over a
24K-120K prefix runs at 516-531 TFLOP/s this way against 302-337 for our Triton extend kernel
(`benchmarks/gpu_kernels.py --only extend --long`), gather of the prefix included. Our kernel
stays for short runs and ragged batches (one launch for every request), and wherever cuDNN
cannot serve: attention windows, logit soft-caps, CPU, a torch without the op.

For new tokens [P, P + E) of one request over its cached prefix [0, P):
  1. its K/V rows (prefix and new, already in the pool) are gathered into contiguous tensors,
     dequantised when the pool stores FP8;
  2. prefix part, no mask: every new token sees every prefix token. GQA costs nothing here: the
     G query heads of a KV head become G x E query rows of that KV head;
  3. new part, causal over the E new tokens (K/V repeated per query head: E rows only);
  4. the two partial outputs are merged by their log-sum-exps (natural log, as cuDNN returns
     them): out = sum_i o_i exp(lse_i - logaddexp(lse_1, lse_2)).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from radixserve.mem.kv_pool import dequantize

logger = logging.getLogger(__name__)

# prefix + new tokens of a request from which its run goes to cuDNN (below, our kernel's single
# launch for the whole batch is as fast or faster); RADIXSERVE_LONG_EXTEND_MIN_TOKENS overrides,
# 0 turns the path off
LONG_EXTEND_MIN_TOKENS = int(os.environ.get("RADIXSERVE_LONG_EXTEND_MIN_TOKENS", "8192"))
# ... and at least this many new tokens: a decode tail of a long request in a MIXED pass (one
# new token) would pay the gather of its whole prefix in every layer
LONG_EXTEND_MIN_NEW_TOKENS = 512

# (q [1, H, Lq, D], k, v [1, H, Lk, D], causal, scale) -> (out [1, H, Lq, D], lse [1, H, Lq])
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float],
                    tuple[torch.Tensor, torch.Tensor]]

_usable: dict[torch.device, bool] = {}  # the probe's verdict per device


def cudnn_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention with its log-sum-exp (torch's private op, stable in 2.5-2.14)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])


def reference_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contract in plain PyTorch (float32 math; tests, and any device)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:  # square: query i sees keys 0..i
        n = q.shape[2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())
    return out.to(q.dtype), lse


def cudnn_usable(device: torch.device) -> bool:
    """cuDNN attention runs on this device: one small call against the reference, once per
    device (any torch without the op, or a cuDNN that refuses it, says no)."""
    if device.type != "cuda" or LONG_EXTEND_MIN_TOKENS <= 0:
        return False
    if device not in _usable:
        try:
            x = torch.randn(1, 2, 64, 128, dtype=torch.bfloat16, device=device)
            out, lse = cudnn_attend(x, x, x, True, 0.1)
            ref, ref_lse = reference_attend(x, x, x, True, 0.1)
            _usable[device] = bool(
                torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2) and
                torch.allclose(lse, ref_lse, atol=1e-2, rtol=1e-3))
        except (RuntimeError, AttributeError, NotImplementedError) as exc:
            logger.info("cuDNN attention unavailable: %s", exc)
            _usable[device] = False
        if not _usable[device]:
            logger.info("long extends use the Triton kernel (cuDNN attention does not run)")
    return _usable[device]


def long_extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                          slots: torch.Tensor, prefix_len: int, scale: float, out: torch.Tensor,
                          kv_scales: tuple[float, float] | None = None,
                          attend: AttendFn = cudnn_attend) -> None:
    """Write into out [E, Hq, D] the attention of q [E, Hq, D] (new tokens at positions
    prefix_len..prefix_len + E - 1) over keys/values at `slots` ([prefix_len + E] pool slots,
    the request's req_to_token row). k/v_buffer: [pool slots, Hkv, D]; kv_scales: the FP8
    pool's (k_scale, v_scale)."""
    num_new, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads

    def heads_first(rows: torch.Tensor) -> torch.Tensor:
        """[S, H, D] rows -> contiguous [1, H, S, D]."""
        return rows.transpose(0, 1).unsqueeze(0).contiguous()

    keys = k_buffer.index_select(0, slots)  # [P + E, Hkv, D]
    values = v_buffer.index_select(0, slots)
    if kv_scales is not None:
        keys = dequantize(keys, kv_scales[0], q.dtype)
        values = dequantize(values, kv_scales[1], q.dtype)
    new_keys = keys[prefix_len:].repeat_interleave(group, dim=1)  # [E, Hq, D]
    new_values = values[prefix_len:].repeat_interleave(group, dim=1)
    out_new, lse_new = attend(heads_first(q), heads_first(new_keys), heads_first(new_values),
                              True, scale)
    out_new = out_new[0].transpose(0, 1)  # [E, Hq, D]
    if prefix_len == 0:
        out.copy_(out_new)
        return
    # query rows (new token e, group member g) of each KV head: [1, Hkv, E * G, D]
    grouped_q = q.view(num_new, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
    grouped_q = grouped_q.reshape(1, num_kv_heads, num_new * group, head_dim)
    out_pre, lse_pre = attend(grouped_q, heads_first(keys[:prefix_len]),
                              heads_first(values[:prefix_len]), False, scale)
    out_pre = out_pre[0].view(num_kv_heads, num_new, group, head_dim).permute(1, 0, 2, 3)
    out_pre = out_pre.reshape(num_new, num_heads, head_dim)
    lse_pre = lse_pre[0].view(num_kv_heads, num_new, group).permute(1, 0, 2)
    lse_pre = lse_pre.reshape(num_new, num_heads, 1).float()
    lse_new = lse_new[0].transpose(0, 1).reshape(num_new, num_heads, 1).float()
    # out = (o_pre e^lse_pre + o_new e^lse_new) / (e^lse_pre + e^lse_new)
    #     = lerp(o_new, o_pre, sigmoid(lse_pre - lse_new))
    weight = torch.sigmoid(lse_pre - lse_new)
    out.copy_(torch.lerp(out_new.float(), out_pre.float(), weight))
