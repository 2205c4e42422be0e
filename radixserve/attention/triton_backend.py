"""The GPU attention backend: Triton split-KV decode and prefix-aware extend kernels.

Invariants:
- No host sync anywhere: Python ints come from the ForwardBatch's CPU lists, never `.item()`.
- Decode splits: the host picks an upper bound of KV splits from the batch size alone
  (`num_kv_splits_for`), so an eager pass and a CUDA-graph replay of the same batch size run the
  same kernels on the same plan and give identical results. The kernel shortens the plan per
  request from its seq_len on the device.
- CUDA graphs: `init_cuda_graph_state` allocates a workspace used only by graphs (never
  reallocated, so captured pointers stay valid). Capture records the runner's fixed
  req_pool_indices / seq_lens buffers; replay copies into them only if it is handed other tensors.
- Rope: given a `RopeInput`, `forward` has the KV pool rotate q/k and store K/V
  (`KVPool.rotate_and_store_kv`: one Triton kernel for the MHA pool instead of a rotary kernel
  plus two index_put launches); forward_extend / forward_decode are then told not to store again.
- Each layer's attention window and logit soft-cap go to the kernels as they are (window -1 and
  cap 0 compile the kernels without either).
- Long extend runs (prefix + new tokens >= LONG_EXTEND_MIN_TOKENS and enough new ones: the
  chunks of a long prompt, not a decode tail) go to cuDNN one request at a time
  (kernels/long_extend.py), the rest of the batch to one Triton launch, in layers without a
  window or soft-cap and where cuDNN runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton

from radixserve.attention.base import AttentionBackend, AttentionContext
from radixserve.attention.kernels.decode_attention import (DecodeKernelConfig,
                                                           decode_attention_fwd,
                                                           default_decode_config, is_fp8)
from radixserve.attention.kernels.extend_attention import (ExtendKernelConfig,
                                                           extend_attention_fwd)
from radixserve.attention.kernels.long_extend import (LONG_EXTEND_MIN_NEW_TOKENS,
                                                      LONG_EXTEND_MIN_TOKENS, cudnn_usable,
                                                      long_extend_attention)
from radixserve.attention.kernels.mla_decode import mla_decode_attention_fwd
from radixserve.attention.mla_plan import MLAExtendPlan

from radixserve.core.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.layers.rotary import RopeInput
    from radixserve.mem.kv_pool import KVStoreTarget


# over an FP8 pool, batches with up to this many one-split programs (batch x KV heads) per SM
# run two splits (num_kv_splits_for)
FP8_TWO_SPLIT_PROGRAMS_PER_SM = 10


@dataclass
class DecodeMetadata:
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs]
    num_kv_splits: int
    mid_out: torch.Tensor  # [bs, H, num_kv_splits, D] float32 workspace
    mid_lse: torch.Tensor  # [bs, H, num_kv_splits] float32 workspace
    config: DecodeKernelConfig  # the split kernel's, for this batch (decode_config_for)


@dataclass
class LongRun:
    """One request's new tokens [token_start, token_start + num_new) for cuDNN."""
    token_start: int
    num_new: int
    prefix_len: int
    slots: torch.Tensor  # [prefix_len + num_new] its req_to_token row


@dataclass
class ExtendMetadata:
    req_pool_indices: torch.Tensor
    extend_start_loc: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    max_extend_len: int
    long_runs: list[LongRun] | None = None  # None: every request goes to the Triton kernel
    others: "ExtendMetadata | None" = None  # with long_runs: the rest of the batch, if any


class DecodeWorkspace:
    """One flat float32 buffer viewed as (mid_out, mid_lse) for any (bs, splits) that fits."""

    def __init__(self, num_elements: int, num_heads: int, head_dim: int,
                 device: torch.device) -> None:
        self.num_heads, self.head_dim = num_heads, head_dim
        self.buffer = torch.empty(num_elements, dtype=torch.float32, device=device)

    @staticmethod
    def elements_for(bs: int, num_splits: int, num_heads: int, head_dim: int) -> int:
        return bs * num_heads * num_splits * (head_dim + 1)

    def fits(self, bs: int, num_splits: int) -> bool:
        need = self.elements_for(bs, num_splits, self.num_heads, self.head_dim)
        return need <= self.buffer.numel()

    def views(self, bs: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        out_elems = bs * self.num_heads * num_splits * self.head_dim
        lse_elems = bs * self.num_heads * num_splits
        mid_out = self.buffer[:out_elems].view(bs, self.num_heads, num_splits, self.head_dim)
        mid_lse = self.buffer[out_elems:out_elems + lse_elems].view(bs, self.num_heads,
                                                                    num_splits)
        return mid_out, mid_lse


def _cudnn_serves(layer: "RadixAttention", dtype: torch.dtype) -> bool:
    """cuDNN's attention applies to this layer: no window or chunks, no soft-cap, no sinks,
    one head width of at most 128, half-precision activations."""
    return _window(layer) < 0 and not layer.attention_chunk and not layer.logit_cap > 0 and \
        layer.sinks is None and \
        layer.head_dim <= 128 and \
        layer.v_head_dim == layer.head_dim and dtype in (torch.bfloat16, torch.float16)


def _window(layer: "RadixAttention") -> int:
    return layer.sliding_window if layer.sliding_window is not None else -1


def _decode_config_from_env() -> DecodeKernelConfig | None:
    """RADIXSERVE_DECODE_CONFIG (DecodeKernelConfig.from_spec's spelling) replaces the decode
    kernel's configuration at every batch size (A/B runs on the GPU; empty: the per-pool,
    per-split default)."""
    spec = os.environ.get("RADIXSERVE_DECODE_CONFIG", "")
    if not spec:
        return None
    return DecodeKernelConfig.from_spec(spec)


class TritonAttnBackend(AttentionBackend):
    def __init__(self, context: AttentionContext, num_kv_splits: int = 16,
                 num_sms: int | None = None, decode_config: DecodeKernelConfig | None = None,
                 extend_config: ExtendKernelConfig | None = None) -> None:
        """num_kv_splits is the most KV splits one decode request is cut into (it sizes the
        workspaces); the other keywords are for kernel tuning and tests."""
        super().__init__(context)
        num_heads, num_kv_heads = context.num_heads, context.num_kv_heads
        assert num_heads % num_kv_heads == 0
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, \
            context.head_dim
        self.value_dim = context.value_dim  # the decode workspaces' width (MLA: the latent)
        self.device = torch.device(context.device)
        self.max_bs, self.max_context_len = context.max_bs, context.max_context_len
        self.max_kv_splits = num_kv_splits
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                       if self.device.type == "cuda" else 132)
        self.num_sms = num_sms
        # None: default_decode_config for the pool's dtype and each batch's split count
        self.decode_config = decode_config or _decode_config_from_env()
        self.kv_dtype = self.kv_pool.kv_buffers(0)[0].dtype if self.kv_pool.layer_num else None
        # K and V codes in two buffers: the split kernel (MLA's latent pool has its own)
        self.fp8_mha_pool = self.kv_dtype is not None and is_fp8(self.kv_dtype) and \
            len(self.kv_pool.kv_buffers(0)) == 2
        self.extend_config = extend_config  # None: chosen from head_dim by the kernel module
        self.workspace = self._new_workspace(self.max_bs)
        # long extend runs through cuDNN: a CUDA device where it runs, a plain MHA pool
        self.long_extend_enabled = len(self.kv_pool.kv_buffers(0)) == 2 and \
            cudnn_usable(self.device) if self.kv_pool.layer_num else False
        self.graph_workspace: DecodeWorkspace | None = None
        self.graph_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.decode_metadata: DecodeMetadata | None = None
        self.extend_metadata: ExtendMetadata | None = None

    # ---- planning ----
    def decode_config_for(self, bs: int) -> DecodeKernelConfig:
        """The decode kernel's config for a batch of bs requests (RADIXSERVE_DECODE_CONFIG's, or
        the default for the pool's dtype and the batch's split plan). A batch that an FP8 pool
        cuts in two where the plain plan runs one split keeps the one-split programs."""
        if self.decode_config is not None:
            return self.decode_config
        splits = 1 if self._fp8_two_splits(bs) else self._plain_kv_splits(bs)
        return default_decode_config(self.kv_dtype, splits)

    def _plain_kv_splits(self, bs: int) -> int:
        """Enough (bs x KV head x split) programs to fill the GPU about twice, a power of two."""
        want = triton.cdiv(2 * self.num_sms, bs * self.num_kv_heads)
        return max(1, min(self.max_kv_splits, triton.next_power_of_2(want)))

    def _fp8_two_splits(self, bs: int) -> bool:
        """Over an FP8 pool, a batch the plain plan runs in one split whose programs number up
        to FP8_TWO_SPLIT_PROGRAMS_PER_SM per SM runs two of its one-warp programs per request:
        H200, Llama-3.1-8B, context 1536, batch 64 / 128 62.4 / 122.2 us per layer against 65.5
        / 142.8 with one split (decode steps at context 1024, FP8 weights and KV: batch 64 /
        128 5.40 / 7.15 ms against 5.75 / 7.45); batch 192 (11.6 per SM) stays faster with one
        (176 against 191). Where the plain plan already cuts two (batch 17-32), the two-warp
        programs stay: one warp measured 4.48 against 4.23 ms per step at batch 32."""
        return (self.fp8_mha_pool and self.max_kv_splits >= 2
                and self._plain_kv_splits(bs) == 1
                and bs * self.num_kv_heads <= FP8_TWO_SPLIT_PROGRAMS_PER_SM * self.num_sms)

    def num_kv_splits_for(self, bs: int) -> int:
        """The split plan: `_plain_kv_splits`, or two for FP8 pools' middle batches."""
        return 2 if self._fp8_two_splits(bs) else self._plain_kv_splits(bs)

    def _new_workspace(self, max_bs: int) -> DecodeWorkspace:
        elements = max(DecodeWorkspace.elements_for(bs, self.num_kv_splits_for(bs),
                                                    self.num_heads, self.value_dim)
                       for bs in range(1, max(1, max_bs) + 1))
        return DecodeWorkspace(elements, self.num_heads, self.value_dim, self.device)

    def _decode_metadata(self, workspace: DecodeWorkspace, bs: int,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
                         ) -> DecodeMetadata:
        num_splits = self.num_kv_splits_for(bs)
        mid_out, mid_lse = workspace.views(bs, num_splits)
        return DecodeMetadata(req_pool_indices, seq_lens, num_splits, mid_out, mid_lse,
                              self.decode_config_for(bs))

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        bs = forward_batch.batch_size
        if forward_batch.forward_mode.is_decode():
            if not self.workspace.fits(bs, self.num_kv_splits_for(bs)):
                self.workspace = self._new_workspace(bs)  # eager only: graphs have their own
            self.decode_metadata = self._decode_metadata(
                self.workspace, bs, forward_batch.req_pool_indices, forward_batch.seq_lens)
            return
        assert forward_batch.extend_seq_lens is not None
        assert forward_batch.extend_seq_lens_cpu is not None
        assert forward_batch.extend_start_loc is not None
        assert forward_batch.extend_prefix_lens is not None
        self.extend_metadata = ExtendMetadata(
            forward_batch.req_pool_indices, forward_batch.extend_start_loc,
            forward_batch.extend_seq_lens, forward_batch.extend_prefix_lens,
            max(forward_batch.extend_seq_lens_cpu, default=0))
        # cuDNN's runs are causal: a pass with images seen both ways stays in one Triton launch
        if self.long_extend_enabled and forward_batch.extend_causal_limit is None:
            self._plan_long_runs(self.extend_metadata, forward_batch)

    def _plan_long_runs(self, meta: ExtendMetadata, forward_batch: ForwardBatch) -> None:
        """Pick the requests whose run goes to cuDNN; the others keep one Triton launch."""
        ext_lens = forward_batch.extend_seq_lens_cpu or []
        prefix_lens = forward_batch.extend_prefix_lens_cpu or []
        long_ids = [i for i, (e, p) in enumerate(zip(ext_lens, prefix_lens))
                    if e + p >= LONG_EXTEND_MIN_TOKENS and e >= LONG_EXTEND_MIN_NEW_TOKENS]
        if not long_ids:
            return
        starts = [0]
        for e in ext_lens[:-1]:
            starts.append(starts[-1] + e)
        table = self.req_to_token_pool.req_to_token
        meta.long_runs = []
        for i in long_ids:
            row = table.index_select(0, meta.req_pool_indices[i:i + 1])[0]
            meta.long_runs.append(LongRun(starts[i], ext_lens[i], prefix_lens[i],
                                          row[:prefix_lens[i] + ext_lens[i]]))
        chosen = set(long_ids)
        other_ids = [i for i in range(len(ext_lens)) if i not in chosen]
        if other_ids:
            pick = torch.tensor(other_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            meta.others = ExtendMetadata(
                meta.req_pool_indices.index_select(0, pick),
                meta.extend_start_loc.index_select(0, pick),
                meta.extend_seq_lens.index_select(0, pick),
                meta.extend_prefix_lens.index_select(0, pick),
                max(ext_lens[i] for i in other_ids))

    # ---- forward ----
    def _store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                  forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        k = k.view(-1, layer.tp_k_head_num, layer.head_dim)
        v = v.view(-1, layer.tp_v_head_num, layer.head_dim)
        self.kv_pool.store_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        return k, v

    def kv_store_target(self, layer: "RadixAttention",
                        forward_batch: ForwardBatch) -> KVStoreTarget | None:
        """Decode passes over an MHA pool that lets other kernels write it (`store_target`):
        the decode kernel reads K/V only from the pool, so whoever stores them there may."""
        if not forward_batch.forward_mode.is_decode():
            return None
        return self.kv_pool.store_target(layer.layer_id, forward_batch.out_cache_loc)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: "RadixAttention", forward_batch: ForwardBatch,
                rope: "RopeInput | None" = None, kv_stored: bool = False) -> torch.Tensor:
        """As the base, but rope and the K/V store run as one fused kernel. Our kernels run on
        whatever device triton does (CUDA, or the CPU interpreter in tests), so does this one.
        kv_stored (decode only, after `kv_store_target`): q is rotated and K/V are stored."""
        if kv_stored:
            assert rope is None and forward_batch.forward_mode.is_decode()
            return self.forward_decode(q, k, v, layer, forward_batch, store_kv=False)
        store_kv = rope is None
        if rope is not None:
            rotary = rope.rotary
            q, k = self.kv_pool.rotate_and_store_kv(
                layer.layer_id, forward_batch.out_cache_loc, q, k, v, rope.positions,
                rotary.cos_cache, rotary.sin_cache, rotary, rope.qk_norm)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, store_kv=store_kv)
        return self.forward_extend(q, k, v, layer, forward_batch, store_kv=store_kv)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: ForwardBatch,
                       store_kv: bool = True) -> torch.Tensor:
        """store_kv=False: k/v are already in the pool (the fused rope kernel wrote them)."""
        meta = self.extend_metadata
        assert meta is not None, "init_forward_metadata was not called"
        if store_kv:
            k, v = self._store_kv(k, v, layer, forward_batch)
        else:
            k = k.view(-1, layer.tp_k_head_num, layer.head_dim)
            v = v.view(-1, layer.tp_v_head_num, layer.head_dim)
        num_heads, head_dim = layer.tp_q_head_num, layer.head_dim
        q = q.view(-1, num_heads, head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_buffer, v_buffer = self.kv_pool.kv_buffers(layer.layer_id)
        triton_meta: ExtendMetadata | None = meta
        if meta.long_runs is not None and _cudnn_serves(layer, q.dtype):
            scales = self.kv_pool.kv_scales(layer.layer_id)
            for run in meta.long_runs:
                rows = slice(run.token_start, run.token_start + run.num_new)
                long_extend_attention(q[rows], k_buffer, v_buffer, run.slots, run.prefix_len,
                                      layer.scaling, out[rows], scales)
            triton_meta = meta.others
        if triton_meta is not None:
            extend_attention_fwd(q, k, v, out, k_buffer, v_buffer,
                                 self.req_to_token_pool.req_to_token,
                                 triton_meta.req_pool_indices, triton_meta.extend_start_loc,
                                 triton_meta.extend_seq_lens, triton_meta.extend_prefix_lens,
                                 triton_meta.max_extend_len, layer.scaling,
                                 self.extend_config, sliding_window=_window(layer),
                                 logit_cap=layer.logit_cap, sinks=layer.sinks,
                                 causal_limit=forward_batch.extend_causal_limit,
                                 attention_chunk=layer.attention_chunk or 0,
                                 **self._scale_args(layer))
        return out.view(-1, num_heads * head_dim)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: ForwardBatch,
                       store_kv: bool = True) -> torch.Tensor:
        """store_kv=False: k/v are already in the pool (the fused rope kernel wrote them)."""
        meta = self.decode_metadata
        assert meta is not None, "init_forward_metadata was not called"
        if store_kv:
            self._store_kv(k, v, layer, forward_batch)
        num_heads, head_dim = layer.tp_q_head_num, layer.head_dim
        q = q.view(-1, num_heads, head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_buffer, v_buffer = self.kv_pool.kv_buffers(layer.layer_id)
        decode_attention_fwd(q, k_buffer, v_buffer, out, self.req_to_token_pool.req_to_token,
                             meta.req_pool_indices, meta.seq_lens, meta.mid_out, meta.mid_lse,
                             layer.scaling, meta.config, sliding_window=_window(layer),
                             logit_cap=layer.logit_cap, sinks=layer.sinks,
                             attention_chunk=layer.attention_chunk or 0,
                             **self._scale_args(layer))
        return out.view(-1, num_heads * head_dim)

    def _scale_args(self, layer: "RadixAttention") -> dict[str, float]:
        """The FP8 pool's per-layer scales for the kernels (nothing when not quantised)."""
        scales = self.kv_pool.kv_scales(layer.layer_id)
        return {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}

    # ---- MLA ----
    def ragged_extend_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                plan: MLAExtendPlan, layer: "RadixAttention",
                                forward_batch: ForwardBatch) -> torch.Tensor:
        """The extend kernel over decompressed K/V: the new tokens' rows are k[P:], the
        prefixes are read through the plan's table. V is zero-padded to the key width (the
        kernel has one head width); the padding's output columns are dropped."""
        meta = self.extend_metadata
        assert meta is not None, "init_forward_metadata was not called"
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        if v_dim < qk_dim:
            v = torch.nn.functional.pad(v, (0, qk_dim - v_dim))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        prefix_rows = plan.num_prefix_tokens
        k_prefix = k[:prefix_rows] if prefix_rows else k
        v_prefix = v[:prefix_rows] if prefix_rows else v
        extend_attention_fwd(q, k[prefix_rows:], v[prefix_rows:], out, k_prefix, v_prefix,
                             plan.prefix_table, plan.rows, meta.extend_start_loc,
                             meta.extend_seq_lens, meta.extend_prefix_lens,
                             meta.max_extend_len, layer.scaling, self.extend_config)
        return out[..., :v_dim]

    def forward_mla_decode(self, q: torch.Tensor, entries: torch.Tensor,
                           layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        meta = self.decode_metadata
        assert meta is not None, "init_forward_metadata was not called"
        self.kv_pool.store_kv(layer.layer_id, forward_batch.out_cache_loc, entries)
        (buffer,) = self.kv_pool.kv_buffers(layer.layer_id)
        out = torch.empty(q.shape[0], q.shape[1], layer.v_head_dim, dtype=q.dtype,
                          device=q.device)
        mla_decode_attention_fwd(q.contiguous(), buffer, out,
                                 self.req_to_token_pool.req_to_token, meta.req_pool_indices,
                                 meta.seq_lens, meta.mid_out, meta.mid_lse, layer.scaling,
                                 layer.v_head_dim,
                                 kv_scale=self._scale_args(layer).get("k_scale", 1.0))
        return out

    # ---- CUDA graphs (decode) ----
    def init_cuda_graph_state(self, max_bs: int) -> None:
        ws = self._new_workspace(max_bs)
        self.graph_workspace = ws
        self.graph_inputs.clear()

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        """req_pool_indices / seq_lens must be the runner's fixed input buffers (>= bs long):
        the captured kernels read them at replay."""
        assert self.graph_workspace is not None, "call init_cuda_graph_state first"
        req_pool_indices, seq_lens = req_pool_indices[:bs], seq_lens[:bs]
        self.graph_inputs[bs] = (req_pool_indices, seq_lens)
        self.decode_metadata = self._decode_metadata(self.graph_workspace, bs,
                                                     req_pool_indices, seq_lens)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int) -> None:
        """The graph for `bs` reads the buffers recorded at capture; padding rows of a replay
        carry req_pool_index 0 and seq_len `get_cuda_graph_seq_len_fill_value()`."""
        captured_indices, captured_lens = self.graph_inputs[bs]
        for captured, given in ((captured_indices, req_pool_indices), (captured_lens, seq_lens)):
            if captured.data_ptr() != given.data_ptr():
                captured.copy_(given[:bs])

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1
