"""ModelRunner: owns the model, the KV pools, the attention backend and the sampler.

It knows nothing of queues: it takes a ModelWorkerBatch, runs one forward pass (eagerly, or by
replaying a CUDA graph for decode), samples, and returns token ids (+ logprobs when asked).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Any

import torch

from radixserve.attention.base import AttentionBackend, AttentionContext
from radixserve.attention.registry import create_attention_backend
from radixserve.config import ServerArgs, resolve_dtype
from radixserve.core.model_config import ModelConfig
from radixserve.core.long_rope import LongRopeSwitch
from radixserve.core.multimodal import image_attention_limits, vision_spec
from radixserve.core.forward_batch import (ForwardBatch, ForwardMode, ForwardOutput,
                                           ModelWorkerBatch)
from radixserve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from radixserve.executor.embedding import (adapt_for_embedding, configure_for_embedding,
                                          forward_embedding)
from radixserve.executor.kv_calibration import calibrate_kv_scales
from radixserve.executor.lora_manager import LoRAManager
from radixserve.executor.memory_budget import hybrid_budget, max_kv_tokens, max_request_slots
from radixserve.executor.pending_step import PendingStep
from radixserve.executor.sampling_info import SamplingBatchInfo
from radixserve.layers.cpu_linear import keep_checkpoint_dtype
from radixserve.layers.recurrent_mixer import attach_recurrent_states, recurrent_state_spec
from radixserve.layers.logits import LogitsOutput
from radixserve.layers.quantization.fp8 import fp8_config, fp8_linears
from radixserve.layers.quantization.int4 import int4_config, int4_linears
from radixserve.layers.quantization.int4_support import check_int4_support
from radixserve.layers.quantization.skipped import keep_unquantized
from radixserve.executor.sampler import (Sampler, compute_input_logprobs, compute_logprobs,
                                         compute_logprobs_on_device)
from radixserve.loader import init_dummy_weights, load_model_source
from radixserve.loader.model_identity import model_digest
from radixserve.loader.model_source import ModelSource
from radixserve.loader.weight_loading import load_weights
from radixserve.mem.kv_pool import (KV_CACHE_DTYPES, KVCacheSpec, KVPool, make_kv_pool,
                                    spec_bytes_per_token)
from radixserve.mem.recurrent_state_pool import RecurrentStatePool
from radixserve.mem.req_to_token_pool import ReqToTokenPool
from radixserve.models.registry import kv_cache_spec, model_class

logger = logging.getLogger(__name__)


def rank_device(device: str, local_rank: int) -> torch.device:
    """The node's local rank r runs on GPU (first + r); on CPU every rank is a CPU process."""
    base = torch.device(device)
    if base.type == "cuda":
        return torch.device("cuda", (base.index or 0) + local_rank)
    return base


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Refuse, before loading, a split the parallel layers cannot make."""
    if tp_size == 1:
        return
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp_size:
        raise ValueError(f"--tp-size {tp_size} does not divide the model's {heads} attention "
                         "heads")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"--tp-size {tp_size} and the model's {kv_heads} KV heads: neither "
                         "divides the other, so KV heads can be neither split nor replicated")


# flags every tensor-parallel rank must be started with alike (the scheduler runs on every rank)
RANK_SHARED_FLAGS = ("tp_size", "nnodes", "load_format", "kv_cache_dtype", "quantization",
                     "lora_paths", "enable_lora", "max_loras", "max_lora_rank",
                     "lora_target_modules",
                     "max_total_tokens", "max_running_requests", "max_prefill_tokens",
                     "chunked_prefill_size", "enable_mixed_chunk", "schedule_policy",
                     "admission_plan", "schedule_conservativeness",
                     "enable_priority_scheduling", "schedule_low_priority_values_first",
                     "priority_scheduling_preemption_threshold",
                     "num_continuous_decode_steps", "disable_radix_cache",
                     "enable_jump_forward", "attention_backend", "prefill_attention_backend",
                     "decode_attention_backend", "disable_cuda_graph",
                     "disable_overlap_schedule", "cuda_graph_max_bs", "stream_interval",
                     "max_queued_requests", "skip_tokenizer_init", "random_seed",
                     "is_embedding", "speculative_algorithm", "speculative_num_draft_tokens",
                     "speculative_ngram_min_match_window_size",
                     "speculative_ngram_max_match_window_size")


class ModelRunner:
    def __init__(self, server_args: ServerArgs, source: ModelSource | None = None,
                 tp_rank: int = 0, dist_init_method: str | None = None) -> None:
        """One tensor-parallel rank (rank 0 of 1 by default). With --tp-size N every rank
        builds its own runner, on GPU `tp_rank` (or a CPU process), and joins the group at
        `dist_init_method` (tcp://host:port) before the model is built."""
        self.server_args = server_args.resolve()
        self.tp_rank, self.tp_size = tp_rank, server_args.tp_size
        self.device = rank_device(server_args.device, server_args.base_gpu_id
                                  + tp_rank - server_args.local_tp_ranks.start)
        t0 = time.perf_counter()
        self.source = source or load_model_source(server_args.model_path,
                                                  server_args.load_format,
                                                  server_args.model_overrides())
        self.model_config: ModelConfig = self.source.model_config
        # the placeholders of the images the model reads (None: text only)
        self.vision_spec = vision_spec(self.model_config.hf_top, self.model_config.architecture)
        self.long_rope = LongRopeSwitch.from_config(self.model_config)  # core/long_rope.py
        self.fp8 = fp8_config(self.source.hf_config.get("quantization_config"),
                              server_args.quantization)
        if self.fp8 is not None and self.fp8.online and self.source.weights is None:
            # dummy weights: build the FP8 parameters directly (no bf16 copy of the model first)
            self.fp8 = dataclasses.replace(self.fp8, online=False)
        self.int4 = int4_config(self.source.hf_config.get("quantization_config"),
                                server_args.quantization, dummy=self.source.weights is None)
        check_tensor_parallel(self.model_config, self.tp_size)
        configure_for_embedding(self.model_config, server_args.is_embedding)
        self.model_config.resolve_context_length(server_args.context_length)
        self.dtype = resolve_dtype(server_args.dtype, self.model_config.torch_dtype,
                                   self.device.type)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.tp_group = init_tensor_parallel(
            tp_rank, self.tp_size, self.device, dist_init_method,
            timeout_s=self.server_args.dist_timeout, nnodes=self.server_args.nnodes,
            fingerprint=self._rank_fingerprint() if self.tp_size > 1 else None)
        self.model = self._load_model()
        self.lora = LoRAManager(self.model, server_args, self.dtype, self.device) \
            if server_args.lora_enabled() else None
        # hybrid models (Qwen3-Next, Qwen3.5): per-request states of the linear attention
        self.state_spec = recurrent_state_spec(self.model, self.dtype)
        self.state_pool: RecurrentStatePool | None = None
        self.kv_cache_spec: KVCacheSpec = dataclasses.replace(
            kv_cache_spec(self.model_config, self.dtype, self.tp_size),
            storage_dtype=KV_CACHE_DTYPES[server_args.kv_cache_dtype])
        logger.info("loaded %s (%s, %s) in %.1f s", self.model_config.architecture,
                    self.dtype, self.device, time.perf_counter() - t0)
        self.sampler = Sampler()
        self.cuda_graph_runner = None
        self._init_memory_pools()
        self.attn_backend = self._make_attn_backend()
        self._apply_kv_cache_scales()
        if self.device.type == "cuda" and not server_args.disable_cuda_graph:
            from radixserve.executor.cuda_graph_runner import CudaGraphRunner
            self.cuda_graph_runner = CudaGraphRunner(self)

    # ---- setup ----
    def _rank_fingerprint(self) -> dict[str, Any]:
        """What every rank must share (distributed/rendezvous.py): the model, and the flags
        that shape its tensors or the scheduler's decisions, which every rank replays (node-local
        ones, such as paths, ports and GPU ids, are left out)."""
        args = self.server_args
        shared = {name: getattr(args, name) for name in RANK_SHARED_FLAGS}
        return {**shared, "model": model_digest(self.source), "dtype": str(self.dtype),
                "device_type": self.device.type,
                "context_length": self.model_config.context_length}

    def _load_model(self) -> torch.nn.Module:
        torch.manual_seed(self.server_args.random_seed)
        model_cls = model_class(self.model_config)
        # parameters are made in the serving dtype where they live: an fp32 copy of a large
        # model first would not fit (70B: 141 GB per GPU at tp 2)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), fp8_linears(self.fp8), int4_linears(self.int4):
                model = model_cls(self.model_config)
                plain = keep_unquantized(model, self.fp8 or self.int4)
                check_int4_support(model, self.int4)
            if self.server_args.is_embedding:
                adapt_for_embedding(model)
        finally:
            torch.set_default_dtype(default_dtype)
        if self.fp8 is not None or self.int4 is not None:
            logger.info("%s weights: %s%s", "FP8" if self.fp8 else "int4",
                        (self.fp8 or self.int4).source,  # type: ignore[union-attr]
                        f"; {len(plain)} layers left unquantised by the checkpoint"
                        if plain else "")
        if self.source.weights is None:
            init_dummy_weights(model, self.server_args.random_seed)
        else:
            load_weights(model, self.source.weights())
        for module in model.modules():
            finish = getattr(module, "finish_loading", None)
            if finish is not None:
                finish()
        # FP8 weights and their float32 scales keep their dtype
        for param in model.parameters():
            if not getattr(param, "keep_dtype", False):
                param.data = param.data.to(self.dtype)
        for buf in model.buffers():
            if buf.is_floating_point():
                buf.data = buf.data.to(self.dtype)
        # rope caches stay fp32: they are cast at use, as transformers does
        for name, buf in model.named_buffers():
            if "cos_cache" in name or "sin_cache" in name:
                buf.data = buf.data.float()
        checkpoint_dtype = getattr(torch, str(self.model_config.torch_dtype), None)
        if (self.device.type == "cpu" and self.dtype == torch.float32
                and self.server_args.dtype == "auto" and checkpoint_dtype != torch.float32):
            keep_checkpoint_dtype(model, checkpoint_dtype)  # float32 compute of a bf16 checkpoint
        model.eval().requires_grad_(False)
        return model

    def _profile_prefill_activation_bytes(self) -> int:
        """Peak memory of one forward at the largest prefill, on a throw-away pool."""
        args = self.server_args
        num_tokens = min(args.chunked_prefill_size if args.chunked_prefill_enabled
                         else args.max_prefill_tokens, self.model_config.context_length - 1)
        self.max_num_reqs = 1
        self.req_to_token_pool = ReqToTokenPool(1, num_tokens + 4, self.device)
        self.token_to_kv_pool = make_kv_pool(num_tokens, self.kv_cache_spec, self.device)
        self._attach_state_pool(1)
        self.attn_backend = self._make_attn_backend()
        slots = self.token_to_kv_pool.alloc(num_tokens)
        self.req_to_token_pool.write(0, 0, slots)
        batch = ModelWorkerBatch(ForwardMode.EXTEND, [1] * num_tokens, [0], [num_tokens], slots,
                                 extend_seq_lens=[num_tokens], extend_prefix_lens=[0])
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.forward_logits(batch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del self.req_to_token_pool, self.token_to_kv_pool, self.attn_backend
        self.state_pool = None
        torch.cuda.empty_cache()
        logger.info("prefill of %d tokens peaks at %.2f GiB of activations", num_tokens,
                    peak / 2**30)
        return peak

    def _init_memory_pools(self) -> None:
        cfg = self.model_config
        activation = self._profile_prefill_activation_bytes() \
            if self.device.type == "cuda" and self.server_args.max_total_tokens is None else 0
        bytes_per_token = spec_bytes_per_token(self.kv_cache_spec)
        # every rank holds the same slots: the smallest budget over the ranks
        snapshots = 0
        if self.state_spec is None:
            self.max_total_num_tokens = self.tp_group.min_int(
                max_kv_tokens(self.server_args, bytes_per_token, self.device, activation))
            self.max_num_reqs = max_request_slots(self.server_args, self.max_total_num_tokens)
        else:
            plan = hybrid_budget(self.server_args, bytes_per_token,
                                 self.state_spec.bytes_per_row(), self.device, activation,
                                 prefix_cache=not self.server_args.disable_radix_cache)
            self.max_total_num_tokens = self.tp_group.min_int(plan.kv_tokens)
            self.max_num_reqs = self.tp_group.min_int(plan.rows)
            snapshots = self.tp_group.min_int(plan.snapshots)
        self.req_to_token_pool = ReqToTokenPool(self.max_num_reqs, cfg.context_length + 4,
                                                self.device)
        self.token_to_kv_pool: KVPool = make_kv_pool(self.max_total_num_tokens,
                                                     self.kv_cache_spec, self.device)
        logger.info("KV cache: %d tokens (%.2f GiB), %d request slots, context %d",
                    self.max_total_num_tokens,
                    self.max_total_num_tokens * bytes_per_token / 2**30,
                    self.max_num_reqs, cfg.context_length)
        self._attach_state_pool(self.max_num_reqs, snapshots)
        if self.state_pool is not None:
            logger.info("recurrent states: %d linear-attention layers, %.1f MiB per request, "
                        "%.2f GiB for %d request slots and %d prefix-cache snapshots",
                        self.state_pool.spec.num_layers,
                        self.state_pool.spec.bytes_per_row() / 2**20,
                        self.state_pool.memory_bytes() / 2**30, self.max_num_reqs,
                        self.state_pool.snapshots)

    def _attach_state_pool(self, rows: int, snapshots: int = 0) -> None:
        """A hybrid model's RecurrentStatePool, one row per ReqToTokenPool row, and
        `snapshots` rows for the prefix cache."""
        if self.state_spec is None:
            return
        self.state_pool = RecurrentStatePool(self.state_spec, rows, self.device, snapshots)
        attach_recurrent_states(self.model, self.state_pool)

    def _apply_kv_cache_scales(self) -> None:
        """An FP8 pool takes the checkpoint's per-layer K/V scales, else keeps 1.0."""
        pool = self.token_to_kv_pool
        if not pool.quantized:
            return
        found: dict[int, dict[str, float]] = getattr(self.model, "kv_cache_scales", {})
        if found:
            for layer, scales in found.items():
                pool.set_kv_scales(layer, scales.get("k", 1.0), scales.get("v", 1.0))
            logger.info("FP8 KV cache (%s): the checkpoint's scales for %d layers", pool.dtype,
                        len(found))
            return
        # every rank calibrates on the same ids, over its own KV heads; the ranks agree on
        # the largest maximum per layer (kv_calibration.py)
        scales = calibrate_kv_scales(self)
        logger.info("FP8 KV cache (%s): no scales in the checkpoint; calibrated per layer "
                    "(k %.3g..%.3g, v %.3g..%.3g)", pool.dtype, min(s[0] for s in scales),
                    max(s[0] for s in scales), min(s[1] for s in scales),
                    max(s[1] for s in scales))

    def _make_attn_backend(self) -> AttentionBackend:
        args, spec = self.server_args, self.kv_cache_spec
        context = AttentionContext(
            num_heads=self.model_config.num_attention_heads // args.tp_size,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            device=self.device, max_bs=self.max_num_reqs,
            req_to_token_pool=self.req_to_token_pool, kv_pool=self.token_to_kv_pool,
            v_head_dim=spec.v_head_dim)
        assert args.prefill_attention_backend and args.decode_attention_backend  # resolve()
        return create_attention_backend(args.prefill_attention_backend,
                                        args.decode_attention_backend, context)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # ---- forward ----
    @torch.inference_mode()
    def forward(self, batch: ModelWorkerBatch) -> ForwardOutput:
        if self.server_args.is_embedding:
            return forward_embedding(self, batch)
        if self._uses_graph(batch):
            logits, greedy_ids = self.cuda_graph_runner.replay(batch)  # type: ignore[union-attr]
            info = batch.sampling_info
            if info is not None and self._argmax_is_the_sample(info) \
                    and not batch.return_logprob:
                # the graph took the argmax already: the id copy is the step's only sync
                return ForwardOutput(greedy_ids.tolist())
            return self._sample(batch, logits, None)
        logits, extend_logits = self.forward_logits(batch)
        return self._sample(batch, logits, extend_logits)

    @staticmethod
    def can_overlap(batch: ModelWorkerBatch) -> bool:
        """Whether an asynchronous launch may run this batch: any decode step
        (`forward_decode_async`), and any EXTEND pass that asks for no prompt logprobs
        (`forward_extend_async`: those are assembled on the host). Penalties and seeds need
        the caller to bring the sampling info up to date on the device
        (SamplingBatchInfo.advance): the requests' output lists are one token behind while a
        step is in flight. The sampled tokens' logprobs are copied back with the ids."""
        if batch.sampling_info is None:
            return False
        if batch.forward_mode.is_decode():
            return True
        return (batch.forward_mode == ForwardMode.EXTEND
                and all(start < 0 for start in batch.extend_logprob_start_lens))

    @torch.inference_mode()
    def forward_extend_async(self, batch: ModelWorkerBatch) -> PendingStep:
        """Launch one EXTEND pass (a prefill batch) and return without waiting for it: the
        scheduler builds and launches its next pass while this one runs, and reads the
        sampled ids from the PendingStep afterwards (see can_overlap)."""
        assert self.can_overlap(batch) and not batch.forward_mode.is_decode(), \
            "this batch needs the synchronous forward"
        assert batch.sampling_info is not None
        logits = self._forward_eager(batch).next_token_logits
        ids = self._sample_ids(logits, batch.sampling_info)
        return self._pending_step(batch, logits, ids)

    @torch.inference_mode()
    def forward_decode_async(self, batch: ModelWorkerBatch,
                             input_ids: torch.Tensor | None = None) -> PendingStep:
        """Launch one decode step and return without waiting for it (see can_overlap).
        `input_ids` ([bs] on the device) replaces batch.input_ids: the overlap path passes the
        ids the step before sampled, which the host has not read yet."""
        assert self.can_overlap(batch), "this batch needs the synchronous forward"
        info = batch.sampling_info
        assert info is not None
        greedy_ids = None
        if self._uses_graph(batch):
            logits, greedy_ids = self.cuda_graph_runner.replay(  # type: ignore[union-attr]
                batch, input_ids)
        else:
            logits = self._forward_eager(batch, input_ids).next_token_logits
        if greedy_ids is not None and self._argmax_is_the_sample(info):
            ids = greedy_ids
        else:
            ids = self._sample_ids(logits, info)
        return self._pending_step(batch, logits, ids)

    @staticmethod
    def _pending_step(batch: ModelWorkerBatch, logits: torch.Tensor,
                      ids: torch.Tensor) -> PendingStep:
        """A launched pass's ids, with their logprobs computed on the device when asked."""
        logprobs = None
        if batch.return_logprob:
            logprobs = compute_logprobs_on_device(logits, ids,
                                                  max(batch.top_logprobs_nums, default=0))
        return PendingStep(ids, logprobs)

    def _sample_ids(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Sampled ids, rank 0's on every rank: the ranks' logits are equal (gathered), and a
        random draw is broadcast too so the ranks can never diverge (a device collective,
        no host sync)."""
        ids = self.sampler.forward(logits, info)
        if self.tp_size > 1 and not self._argmax_is_the_sample(info):
            self.tp_group.broadcast(ids)
        return ids

    def shutdown(self) -> None:
        """Leave the tensor-parallel group and release the device memory this runner holds
        (weights, KV pools, CUDA graphs and their pool), so the process may build another
        runner. The runner cannot run again."""
        destroy_tensor_parallel()
        self.cuda_graph_runner = None
        for name in ("model", "attn_backend", "token_to_kv_pool", "req_to_token_pool",
                     "state_pool"):
            if hasattr(self, name):
                setattr(self, name, None)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @property
    def decode_graph_rows(self) -> int | None:
        """The most rows a DECODE pass replays a CUDA graph for; None: decode runs eagerly."""
        return getattr(self.cuda_graph_runner, "max_bs", None)

    @staticmethod
    def _argmax_is_the_sample(info: SamplingBatchInfo) -> bool:
        """The decode graph's argmax of the raw logits is the sampled token."""
        return info.is_all_greedy and not info.modifies_logits

    def _uses_graph(self, batch: ModelWorkerBatch) -> bool:
        return (self.cuda_graph_runner is not None and batch.forward_mode.is_decode()
                and self.cuda_graph_runner.can_run(batch))

    @torch.inference_mode()
    def forward_logits(self, batch: ModelWorkerBatch) -> LogitsOutput:
        """Run the model: last-position logits per request (+ all extend logits if asked).
        A DECODE pass first records its new KV slots in req_to_token."""
        if self._uses_graph(batch):  # float32, as the eager path gives them
            return LogitsOutput(self.cuda_graph_runner.replay(batch)[0].float(),  # type: ignore
                                None)
        return self._forward_eager(batch)

    def _forward_eager(self, batch: ModelWorkerBatch,
                       input_ids: torch.Tensor | None = None) -> LogitsOutput:
        fb = self.prepare_forward(batch, input_ids)
        return self.model(fb.input_ids, fb.positions, fb)

    def prepare_forward(self, batch: ModelWorkerBatch,
                        input_ids: torch.Tensor | None = None) -> ForwardBatch:
        """The eager pass's ForwardBatch, its decode slots recorded and the backend's
        metadata built (`input_ids` on the device replaces the batch's)."""
        fb = ForwardBatch.from_worker_batch(batch, self.device, self.attn_backend)
        if fb.mm_inputs is not None and self.vision_spec is not None and \
                self.vision_spec.bidirectional and fb.forward_mode.is_extend():
            fb.extend_causal_limit = torch.tensor(image_attention_limits(
                fb.mm_inputs, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu),
                dtype=torch.int32).to(self.device, non_blocking=True)
        if input_ids is not None:
            fb.input_ids = input_ids
        if self.lora is not None:
            self.lora.prepare(batch)
        self.record_decode_slots(fb)  # before the metadata: a backend may read the table then
        self.attn_backend.init_forward_metadata(fb)
        return fb

    def record_decode_slots(self, fb: ForwardBatch) -> None:
        """A DECODE pass records its new KV slots in req_to_token on the device (the host copy
        has them from the BatchBuilder). The decode CUDA graph captures this call too."""
        if fb.forward_mode.is_decode():
            self.req_to_token_pool.write_decode_slots(fb.req_pool_indices, fb.seq_lens,
                                                      fb.out_cache_loc)

    def _sample(self, batch: ModelWorkerBatch, logits: torch.Tensor,
                extend_logits: torch.Tensor | None) -> ForwardOutput:
        assert batch.sampling_info is not None
        next_ids = self._sample_ids(logits, batch.sampling_info)
        if not batch.return_logprob:
            return ForwardOutput(next_ids.tolist())
        chosen, top = compute_logprobs(logits, next_ids, batch.top_logprobs_nums)
        input_lp = input_top = None
        if extend_logits is not None:
            input_lp, input_top = self._input_logprobs(batch, extend_logits)
        return ForwardOutput(next_ids.tolist(), chosen.tolist(), top, input_lp, input_top)

    def _input_logprobs(self, batch: ModelWorkerBatch, extend_logits: torch.Tensor
                        ) -> tuple[list[list[tuple[float, int]]], list[list[list[tuple[float, int]]]]]:
        """Logprob of each prompt token given the tokens before it, per request."""
        token_lps: list[list[tuple[float, int]]] = []
        top_lps: list[list[list[tuple[float, int]]]] = []
        offset = 0
        for i, ext_len in enumerate(batch.extend_seq_lens):
            start = batch.extend_logprob_start_lens[i]
            targets = batch.extend_next_token_ids[i][max(start, 0):] if start >= 0 else []
            if not targets:
                token_lps.append([])
                top_lps.append([])
            else:
                # the logits at extend position p predict the prompt token after p
                rows = extend_logits[offset + start:offset + start + len(targets)]
                lp, top = compute_input_logprobs(
                    rows, torch.tensor(targets, device=rows.device), batch.top_logprobs_nums[i])
                token_lps.append(list(zip(lp.tolist(), targets)))
                top_lps.append(top)
            offset += ext_len
        return token_lps, top_lps
