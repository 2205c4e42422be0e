"""The CPU backend: torch_native with compiled kernels (radixserve/core/cpu_kernels) on the hot path.

  * decode (and the one-token tail of a MIXED pass): one kernel per layer reads each request's
    K/V straight from the pool through its req_to_token row (no gather, no padding, no mask);
    task (request, KV head) serves the KV head's whole group of query heads (GQA), scores,
    softmax and the weighted sum of V in fp32; windows, attention chunks and logit soft-caps
    are honoured;
  * rope: one kernel rotates q and k in place and copies rotated k and v into the pool at
    `out_cache_loc` (instead of ~20 small ops and two index_put's per layer);
  * fp32 extend (and MIXED) passes whose longest new run is at most EXTEND_KERNEL_MAX_TOKENS:
    the same kernel, each new token a one-token "request" over its own causal prefix of the
    request's row (no gather, no padded queries, no mask; 1.5x faster than the padded SDPA at
    64 x 128 tokens on 2 cores); longer runs: torch_native's padded SDPA, whose tiled matmuls
    win from ~512 tokens on. In bf16/fp16 the prompt keeps the padded SDPA, whose rounding is
    Hugging Face's: the kernel's fp32 softmax and weighted sum are closer to the fp32 result,
    but on the bundled SmolLM2 that moved "What is the capital of France?" onto a bf16 tie of
    the first answer token (logprob -1.895 for both "The" and "L"; fp32: -1.883 vs -1.965), and
    argmax then left Paris.

Falls back to torch_native wherever the kernels do not apply: no compiled kernels (no
toolchain, RADIXSERVE_CPU_KERNELS=0), a pool whose buffers are not in the activations' dtype
(FP8 storage), an MLA pool, head dims not a multiple of 16, attention sinks (gpt-oss), partial
rotary or a rotary of another kind.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.attention.base import AttentionContext
from radixserve.attention.torch_native import PaddedPart, TorchNativeAttnBackend
from radixserve.core.cpu_kernels import cpu_ops
from radixserve.core.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.layers.rotary import RopeInput

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the per-token kernel over a request's causal prefix costs ~q_len^2 vector dot products and
# SDPA's flash path ~q_len^2 matmul FLOPs: fp32 on 2 cores, the kernel is ahead up to 512 new
# tokens (64 x 128: 19.0 vs 23.5 ms per layer; 4 x 512: 14.8 vs 16.5) and behind at 1,024
EXTEND_KERNEL_MAX_TOKENS = 256


class CPUAttnBackend(TorchNativeAttnBackend):
    def __init__(self, context: AttentionContext) -> None:
        super().__init__(context)
        buffers = self.kv_pool.kv_buffers(0) if self.kv_pool.layer_num else ()
        plain_mha = len(buffers) == 2 and buffers[0].dtype in _KERNEL_DTYPES and \
            self.kv_pool.kv_scales(0) is None
        self.ops = cpu_ops() if plain_mha and context.device.type == "cpu" else None
        self.extend_by_kernel = self.ops is not None and buffers[0].dtype == torch.float32
        # token_start of a one-token-per-request part -> (its req_pool_indices, seq_lens)
        self._decode_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # every token of the pass as a one-token request: (req_pool_index, causal length)
        self._token_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._batch: ForwardBatch | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._decode_rows = {}
        self._token_rows = None
        self._batch = forward_batch
        self.parts = []  # padded parts are built lazily where a layer falls back
        if self.ops is not None and forward_batch.forward_mode.is_decode():
            self._token_rows = (forward_batch.req_pool_indices, forward_batch.seq_lens)
            return
        if self.extend_by_kernel and \
                max(forward_batch.extend_seq_lens_cpu) <= EXTEND_KERNEL_MAX_TOKENS:
            self._token_rows = _per_token_rows(forward_batch)
            return
        super().init_forward_metadata(forward_batch)

    def _part(self, forward_batch: ForwardBatch, req_start: int, req_end: int,
              token_start: int, q_lens_cpu: list[int]) -> PaddedPart:
        if max(q_lens_cpu) == 1:
            self._decode_rows[token_start] = (forward_batch.req_pool_indices[req_start:req_end],
                                              forward_batch.seq_lens[req_start:req_end])
        return super()._part(forward_batch, req_start, req_end, token_start, q_lens_cpu)

    def _kernel_ok(self, q: torch.Tensor, layer: "RadixAttention") -> bool:
        """The kernels apply: built, the pool in q's dtype, head dims a multiple of 16 (the
        widest vector the kernel may be built for), no attention sinks."""
        return self.ops is not None and layer.sinks is None and layer.head_dim % 16 == 0 and \
            layer.v_head_dim % 16 == 0 and \
            self.kv_pool.kv_buffers(layer.layer_id)[0].dtype == q.dtype

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: "RadixAttention", forward_batch: ForwardBatch,
                rope: "RopeInput | None" = None, kv_stored: bool = False) -> torch.Tensor:
        if kv_stored:  # never: kv_store_target is the base's None
            raise NotImplementedError("the CPU backend stores K/V itself")
        if not self._kernel_ok(q, layer):
            self._ensure_parts(forward_batch)
            return super().forward(q, k, v, layer, forward_batch, rope)
        if rope is not None and rope.qk_norm is not None:  # the rope kernel takes normed q/k
            q, k = rope.normed(q, k)
            rope = rope.unnormed()
        k_buf, v_buf = self.kv_pool.kv_buffers(layer.layer_id)
        rotary = rope.rotary if rope is not None else None
        if rotary is not None and _plain_rotary(rotary) and q.dim() == 2 and \
                q.stride(1) == 1 and k.stride(1) == 1 and v.stride(1) == 1:
            self.ops.rope_store(rope.positions, q, k, v, rotary.cos_cache, rotary.sin_cache,
                                rotary.head_dim, k_buf, v_buf, forward_batch.out_cache_loc, True)
        else:
            if rope is not None:
                q, k = rope.rotary(rope.positions, q, k)
            self.kv_pool.store_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        if self._token_rows is not None and not _window_past_limit(layer, forward_batch):
            return self._kernel_decode(q, layer, *self._token_rows)
        self._ensure_parts(forward_batch)
        outs = []
        for part in self.parts:
            q_part = q[part.token_start:part.token_end]
            if part.max_q_len == 1:
                outs.append(self._kernel_decode(q_part, layer,
                                                *self._decode_rows[part.token_start]))
            else:
                outs.append(self._attend_padded(q_part, part, layer))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _kernel_decode(self, q: torch.Tensor, layer: "RadixAttention",
                       req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """q: [bs, Hq * D] (rows may be strided) -> [bs, Hq * Dv]."""
        k_buf, v_buf = self.kv_pool.kv_buffers(layer.layer_id)
        bs, num_heads = q.shape[0], layer.tp_q_head_num
        out = q.new_empty(bs, num_heads, layer.v_head_dim)
        self.ops.decode_attention(q.view(bs, num_heads, layer.head_dim), k_buf, v_buf, out,
                                  self.req_to_token_pool.req_to_token, req_pool_indices,
                                  seq_lens, layer.scaling, float(layer.logit_cap),
                                  layer.sliding_window or 0, layer.attention_chunk or 0)
        return out.view(bs, num_heads * layer.v_head_dim)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        if not self._kernel_ok(q, layer):
            self._ensure_parts(forward_batch)
            return super().forward_decode(q, k, v, layer, forward_batch)
        self.kv_pool.store_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        return self._kernel_decode(q, layer, *self._token_rows)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        if self._token_rows is None or not self._kernel_ok(q, layer) or \
                _window_past_limit(layer, forward_batch):
            self._ensure_parts(forward_batch)
            return super().forward_extend(q, k, v, layer, forward_batch)
        self.kv_pool.store_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        return self._kernel_decode(q, layer, *self._token_rows)

    def _ensure_parts(self, forward_batch: ForwardBatch) -> None:
        """The padded parts torch_native attends over, for a layer the kernel cannot serve."""
        if not self.parts:
            super().init_forward_metadata(forward_batch)


def _window_past_limit(layer: "RadixAttention", forward_batch: ForwardBatch) -> bool:
    """A windowed (or chunked) layer in a pass whose tokens see past themselves: the kernel
    would count the window back from the last key a token sees, not from the token
    (torch_native's parts serve it)."""
    return bool(layer.sliding_window or layer.attention_chunk) and \
        forward_batch.extend_causal_limit is not None


def _per_token_rows(forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token of an extend pass as a one-token request: its request's req_to_token row
    and its causal length (prefix + its index in the new run + 1; past it to its limit where
    the pass has ForwardBatch.extend_causal_limit)."""
    ext_lens = forward_batch.extend_seq_lens
    num_tokens = forward_batch.num_tokens
    rows = torch.repeat_interleave(forward_batch.req_pool_indices, ext_lens,
                                   output_size=num_tokens)
    prefix_minus_start = forward_batch.seq_lens - ext_lens - forward_batch.extend_start_loc
    first = torch.repeat_interleave(prefix_minus_start, ext_lens, output_size=num_tokens)
    if forward_batch.extend_causal_limit is not None:  # keys up to each token's limit
        prefix = torch.repeat_interleave(forward_batch.seq_lens - ext_lens, ext_lens,
                                         output_size=num_tokens)
        return rows, prefix + forward_batch.extend_causal_limit.to(torch.int64) + 1
    return rows, first + torch.arange(1, num_tokens + 1, device=rows.device)


def _plain_rotary(rotary: object) -> bool:
    """The neox-layout RotaryEmbedding over whole heads (what the rope kernel implements)."""
    from radixserve.layers.rotary import RotaryEmbedding
    return type(rotary) is RotaryEmbedding and rotary.rotary_dim == rotary.head_dim and \
        rotary.cos_cache.dtype == torch.float32
