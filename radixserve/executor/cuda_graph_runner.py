"""Decode CUDA graphs: capture the model's decode step for a list of batch sizes, then replay.

A decode step of a few requests is launch-bound: hundreds of small kernels whose launch costs
more than their work. Capturing the step once per batch size and replaying the graph removes that
overhead.

Invariants:
- Fixed inputs. One device tensor `[5, max_bs]` holds the rows input_ids, positions,
  req_pool_indices, seq_lens and out_cache_loc; every graph reads slices `[:bs]` of those rows,
  so a replay only refills them (one host-to-device copy from a pinned staging buffer, which is
  rewritten only after the previous copy out of it has completed).
- Padding. A batch of `bs` requests replays the smallest captured size `graph_bs >= bs`. The
  `graph_bs - bs` padding rows carry input id 0, position 0, req_pool_index
  `req_to_token_pool.padding_row`, seq_len `attn_backend.get_cuda_graph_seq_len_fill_value()`
  and out_cache_loc 0: their K/V land in KV slot 0 (the padding sink, never handed out), their
  table write in the padding row, and their outputs are dropped.
- LoRA adapters (--lora-paths): every size is captured twice, without adapter code (steps of
  the base model alone pay nothing for the adapters) and with the per-row LoRA kernels
  (layers/kernels/lora_rows.py) reading a sixth input row, each request's adapter slot (-1:
  none, and for the padding rows).
- A graph is the whole decode step short of sampling: the write of the new KV slots into
  req_to_token, the model, and the argmax of the logits (greedy batches need nothing else).
- One memory pool (`torch.cuda.graph_pool_handle()`) is shared by all graphs, captured largest
  first so the smaller ones fit in the memory the largest already reserved. What a graph returns
  stays allocated while it lives, so the logits of every size go into the first rows of one
  `[max_bs, vocab]` buffer (`ForwardBatch.logits_out`); the argmax ids live in the pool. Both
  are valid until the next replay (whose sampling and logprobs are enqueued right after it).
- The logits stay in the compute dtype (float32 only under a final logit cap, or with
  RADIXSERVE_GRAPH_BF16_LOGITS=0): the LM head's cuBLAS product writes the buffer itself and
  the argmax reads half the bytes, where a float32 buffer costs a cast of [bs, vocab] every
  step (0.33 ms at batch 896 on an H200; FP8 W + KV decode at batch 896 measured 31.14 against
  31.38 ms, gpu_fp8.sh logits_ab). The argmax is the same token (the cast is exact and
  monotone); the sampler and the logprobs convert the rows they read.
- No host sync: a replay copies host data in (H2D) and launches the graph; nothing is read back.
- Backends without graph support (torch_native) raise NotImplementedError from
  `init_cuda_graph_state`; the runner then captures nothing and `can_run` is always False.
"""
from __future__ import annotations

import bisect
import logging
import os
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch

from radixserve.core.progress import progress
from radixserve.core.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch

if TYPE_CHECKING:
    from radixserve.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

NUM_INPUT_ROWS = 5  # input_ids, positions, req_pool_indices, seq_lens, out_cache_loc
INPUT_IDS, POSITIONS, REQ_POOL_INDICES, SEQ_LENS, OUT_CACHE_LOC = range(NUM_INPUT_ROWS)
LORA_SLOTS = NUM_INPUT_ROWS  # the sixth row, with LoRA adapters: each request's slot
NUM_WARMUP_RUNS = 2
LOGITS_IN_MODEL_DTYPE = os.environ.get("RADIXSERVE_GRAPH_BF16_LOGITS", "1") == "1"


def capture_batch_sizes(cuda_graph_max_bs: int, max_num_reqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 from 16 to 256 and every 16 above, up to
    min(cuda_graph_max_bs, max_num_reqs); ascending.

    When the cap falls between two steps, the cap itself is added so that every batch up to it
    can replay a graph."""
    cap = min(cuda_graph_max_bs, max_num_reqs)
    if cap < 1:
        return []
    steps = [1, 2, 4, 8, *range(16, 257, 8), *range(272, cap + 1, 16)]
    sizes = [bs for bs in steps if bs <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def pick_graph_batch_size(batch_sizes: Sequence[int], bs: int) -> int:
    """The smallest captured size >= bs (batch_sizes ascending). ValueError if none fits."""
    i = bisect.bisect_left(batch_sizes, bs)
    if bs < 1 or i == len(batch_sizes):
        raise ValueError(f"no captured CUDA graph for batch size {bs} (sizes {list(batch_sizes)})")
    return batch_sizes[i]


class PaddingPlan(NamedTuple):
    graph_bs: int  # the captured size that is replayed
    num_padding: int  # graph_bs - bs padding rows after the real ones
    seq_lens_sum: int  # over all graph_bs rows, padding included


def fill_padded_inputs(batch: ModelWorkerBatch, graph_bs: int, seq_len_fill: int,
                       padding_row: int, out: torch.Tensor,
                       lora_slots: list[int] | None = None) -> PaddingPlan:
    """Write the batch's decode inputs into `out[:, :graph_bs]` (a CPU int64 `[5, >= graph_bs]`
    tensor, rows in the order of the module constants; a sixth row takes `lora_slots`, the
    requests' adapter slots), padding rows after the real ones."""
    bs = batch.batch_size
    if bs > graph_bs:
        raise ValueError(f"batch of {bs} does not fit a graph of {graph_bs}")
    rows = out.numpy()  # shares memory: numpy takes Python lists without per-element tensors
    rows[INPUT_IDS, :bs] = batch.input_ids
    rows[SEQ_LENS, :bs] = batch.seq_lens
    rows[POSITIONS, :bs] = batch.decode_positions()  # with M-RoPE images' shifts
    rows[REQ_POOL_INDICES, :bs] = batch.req_pool_indices
    rows[OUT_CACHE_LOC, :bs] = batch.out_cache_loc.numpy()
    rows[:, bs:graph_bs] = 0
    rows[SEQ_LENS, bs:graph_bs] = seq_len_fill
    rows[REQ_POOL_INDICES, bs:graph_bs] = padding_row
    if lora_slots is not None:
        rows[LORA_SLOTS, :bs] = lora_slots
        rows[LORA_SLOTS, bs:graph_bs] = -1
    num_padding = graph_bs - bs
    return PaddingPlan(graph_bs, num_padding, sum(batch.seq_lens) + num_padding * seq_len_fill)


class CudaGraphRunner:
    """Captures decode graphs at construction (the ModelRunner builds one on CUDA unless
    --disable-cuda-graph) and replays them for decode batches up to the largest captured size."""

    def __init__(self, model_runner: "ModelRunner") -> None:
        self.model_runner = model_runner
        self.attn_backend = model_runner.attn_backend
        self.device = model_runner.device
        args = model_runner.server_args
        max_bs_flag = args.cuda_graph_max_bs or 256  # resolve() sets it
        # speculative decoding verifies drafts as extra rows: up to 1 + drafts a request
        rows_per_req = 1 + (args.speculative_num_draft_tokens if args.speculative_algorithm
                            else 0)
        sizes = capture_batch_sizes(max_bs_flag, model_runner.max_num_reqs * rows_per_req)
        self.batch_sizes: list[int] = []
        # keyed by (batch size, with the LoRA kernels)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self.lora = getattr(model_runner, "lora", None)  # its LoRAManager, if it has adapters
        if self.lora is not None and not self.lora.rows_kernel:
            self.lora = None  # RADIXSERVE_LORA_ROWS_KERNEL=0: adapter steps run eager
        if not sizes:
            return
        try:
            self.attn_backend.init_cuda_graph_state(sizes[-1])
        except NotImplementedError as exc:
            logger.warning("CUDA graphs disabled, decode runs eagerly: %s", exc)
            return
        self.max_bs = sizes[-1]
        self.padding_row = model_runner.req_to_token_pool.padding_row
        self.seq_len_fill = self.attn_backend.get_cuda_graph_seq_len_fill_value()
        num_rows = NUM_INPUT_ROWS + (self.lora is not None)
        with torch.inference_mode():
            self.inputs = torch.zeros((num_rows, self.max_bs), dtype=torch.int64,
                                      device=self.device)
            self.inputs[SEQ_LENS].fill_(self.seq_len_fill)
            self.inputs[REQ_POOL_INDICES].fill_(self.padding_row)
            if self.lora is not None:
                self.inputs[LORA_SLOTS].fill_(-1)
            self.staging = torch.zeros((num_rows, self.max_bs), dtype=torch.int64,
                                       pin_memory=True)
        self.copy_done = torch.cuda.Event()
        self.copy_done.record()
        # every graph writes its logits into the first rows of this one buffer: a graph's own
        # output tensor stays allocated in the pool for as long as the graph lives, and
        # [bs, vocab] fp32 for each of 51 sizes up to 512 held 5.2 GiB (Llama-3.1-8B)
        self.logits_out: torch.Tensor | None = None
        self._capture_all(sizes)

    # ---- capture ----
    def _forward_batch(self, bs: int) -> ForwardBatch:
        rows = self.inputs
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs,
            input_ids=rows[INPUT_IDS, :bs], positions=rows[POSITIONS, :bs],
            req_pool_indices=rows[REQ_POOL_INDICES, :bs], seq_lens=rows[SEQ_LENS, :bs],
            out_cache_loc=rows[OUT_CACHE_LOC, :bs],
            seq_lens_sum=bs * self.seq_len_fill, seq_lens_cpu=[self.seq_len_fill] * bs,
            attn_backend=self.attn_backend, logits_in_model_dtype=LOGITS_IN_MODEL_DTYPE)

    @torch.inference_mode()
    def _capture_all(self, sizes: list[int]) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        # largest first: the others reuse its memory
        keys = [(bs, with_lora) for with_lora in (False, True)[:1 + (self.lora is not None)]
                for bs in reversed(sizes)]
        for key in progress(keys, "capturing CUDA graphs", "graph"):
            try:
                self.graphs[key], self.outputs[key] = self._capture_one(*key, pool)
            except RuntimeError as exc:
                if key != keys[0] or os.environ.get("RADIXSERVE_PDL") == "0":
                    raise
                # a driver that cannot capture programmatic launches: capture without them
                from radixserve.core.triton_pdl import disable_pdl
                logger.warning("CUDA graph capture failed (%s); retrying without PDL", exc)
                disable_pdl()
                torch.cuda.synchronize(self.device)
                self.graphs[key], self.outputs[key] = self._capture_one(*key, pool)
        self.batch_sizes = sorted(sizes)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured decode CUDA graphs for %d batch sizes (%s)%s in %.1f s, %.2f GiB",
                    len(sizes), ", ".join(map(str, sizes)),
                    ", with and without the LoRA kernels" if self.lora is not None else "",
                    time.perf_counter() - start, used / 2**30)

    def _decode_step(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.model_runner.record_decode_slots(fb)
        logits = self.model_runner.model(fb.input_ids, fb.positions, fb).next_token_logits
        return logits, logits.argmax(dim=-1)

    def _capture_one(self, bs: int, with_lora: bool, pool: Any
                     ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
        if self.lora is None:
            return self._capture_step(bs, pool)
        with self.lora.capturing(self.inputs[LORA_SLOTS, :bs] if with_lora else None):
            return self._capture_step(bs, pool)

    def _capture_step(self, bs: int, pool: Any
                      ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
        forward_batch = self._forward_batch(bs)
        self.attn_backend.init_forward_metadata_capture_cuda_graph(
            bs, self.inputs[REQ_POOL_INDICES], self.inputs[SEQ_LENS])
        # warm-up: triton autotuning / compilation and lazy allocations stay out of the graph;
        # the inputs hold padding values, so these runs only write KV slot 0 and the padding row
        for _ in range(NUM_WARMUP_RUNS):
            logits, _ = self._decode_step(forward_batch)
        if self.logits_out is None:  # the largest size comes first: its rows serve them all
            self.logits_out = torch.empty((self.max_bs, logits.shape[-1]), dtype=logits.dtype,
                                          device=self.device)
        del logits
        forward_batch.logits_out = self.logits_out
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = self._decode_step(forward_batch)
        return graph, outputs

    # ---- replay ----
    def can_run(self, batch: ModelWorkerBatch) -> bool:
        """A captured size fits the batch, and its adapters (if any) have graphs."""
        if any(batch.lora_names) and self.lora is None:
            return False
        return bool(self.batch_sizes) and 1 <= batch.batch_size <= self.batch_sizes[-1]

    @torch.inference_mode()
    def replay(self, batch: ModelWorkerBatch, input_ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode logits [bs, vocab] (in the compute dtype; float32 under a final logit cap or
        with RADIXSERVE_GRAPH_BF16_LOGITS=0) and their argmax [bs], valid until the next replay.
        `input_ids` (device, [bs]) replaces batch.input_ids (the overlap path)."""
        bs = batch.batch_size
        graph_bs = pick_graph_batch_size(self.batch_sizes, bs)
        lora_slots = None
        if self.lora is not None and any(batch.lora_names):
            lora_slots = [self.lora.slot_of(name) for name in batch.lora_names]
        self.copy_done.synchronize()  # the previous copy out of `staging` has finished
        plan = fill_padded_inputs(batch, graph_bs, self.seq_len_fill, self.padding_row,
                                  self.staging, lora_slots)
        # the whole buffer (a few KiB) in one contiguous copy; rows past graph_bs are not read
        self.inputs.copy_(self.staging, non_blocking=True)
        self.copy_done.record()
        if input_ids is not None:  # device to device, ordered before the replay
            self.inputs[INPUT_IDS, :bs].copy_(input_ids)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            graph_bs, self.inputs[REQ_POOL_INDICES, :graph_bs], self.inputs[SEQ_LENS, :graph_bs],
            plan.seq_lens_sum)
        key = (graph_bs, lora_slots is not None)
        self.graphs[key].replay()
        logits, ids = self.outputs[key]
        return logits[:bs], ids[:bs]
