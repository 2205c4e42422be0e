"""The batch types every layer shares: ModelWorkerBatch, ForwardBatch, ForwardOutput.

They live in `core` so that attention backends, layers, models, the executor and the scheduler
all import them downward. The scheduler hands the ModelRunner a ModelWorkerBatch (plain CPU
data); the runner turns it into a ForwardBatch on the model's device. Attention backends read
the fields below and keep their own metadata object (no backend-specific field lives here); the
pools a backend reads are the backend's own (given at construction), not the batch's.

Index conventions (bs = batch size, T = number of tokens in this pass):
  input_ids, positions, out_cache_loc: [T]. out_cache_loc are the KV slots this pass writes.
  seq_lens: [bs], the length of each sequence *including* this pass's tokens.
  EXTEND: extend_seq_lens[i] new tokens of request i sit on top of extend_prefix_lens[i] cached
    ones; tokens are packed request after request, extend_start_loc[i] = sum(extend_seq_lens[:i]).
  DECODE: one token per request, T == bs.
  MIXED: an extend batch whose last `decode_bs` requests have extend_seq_len 1 (chunk + decodes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, NamedTuple

import torch


class ForwardMode(Enum):
    EXTEND = auto()
    DECODE = auto()
    MIXED = auto()
    IDLE = auto()

    def is_extend(self) -> bool:
        """MIXED runs through the extend path of attention."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ModelWorkerBatch:
    """What the scheduler sends to the ModelRunner. CPU data only."""
    forward_mode: ForwardMode
    input_ids: list[int]
    req_pool_indices: list[int]
    seq_lens: list[int]
    out_cache_loc: torch.Tensor  # int64 CPU
    extend_seq_lens: list[int] = field(default_factory=list)
    extend_prefix_lens: list[int] = field(default_factory=list)
    # requests whose logits are needed (False: an intermediate prefill chunk)
    # executor.sampling_info.SamplingBatchInfo (typed loosely: core imports nothing above it)
    sampling_info: Any = None
    return_logprob: bool = False
    top_logprobs_nums: list[int] = field(default_factory=list)
    # for each request, the position inside its extend tokens from which input logprobs are wanted
    # (-1: none); only meaningful when return_logprob
    extend_logprob_start_lens: list[int] = field(default_factory=list)
    # for each request, the prompt tokens that follow each of its extend positions (targets of
    # the input logprobs; shorter than extend_seq_len at the end of the prompt)
    extend_next_token_ids: list[list[int]] = field(default_factory=list)
    # EXTEND / MIXED, hybrid models: (request index, tokens into its extend, RecurrentStatePool
    # row): the pass copies the request's states after that many of its extend tokens into the
    # row, for the prefix cache to keep there (mem/hybrid_radix_cache.py: before a prompt's
    # last token, and where a prompt parts from a cached one)
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    # per request, its LoRA adapter's name or None (empty: none in the pass)
    lora_names: list[str | None] = field(default_factory=list)
    # EXTEND / MIXED: per request, the images of its prompt (core.multimodal.ImageInput) whose
    # placeholders this pass may cover (empty: no request of the pass has images)
    mm_inputs: list[list[Any]] = field(default_factory=list)
    # per request, what its positions add to its token indices (empty: 0 for all): M-RoPE
    # models place the tokens after an image at their index plus the images' rope deltas
    # (core.multimodal.ImageInput.rope_delta; for an extend pass, those of the images that
    # end before its first token, the model placing the rest by `mrope_positions`); a request
    # on LongRoPE's long table adds the table's first row (core/long_rope.py)
    position_offsets: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)

    def decode_positions(self) -> list[int]:
        """DECODE: each row's position, the one after its cache (its length - 1), plus its
        offset; the eager pass and the CUDA graphs' inputs both take these."""
        if not self.position_offsets:
            return [s - 1 for s in self.seq_lens]
        return [s - 1 + shift for s, shift in zip(self.seq_lens, self.position_offsets)]


class ForwardOutput(NamedTuple):
    """What a forward pass returns to the scheduler: host lists, one entry per request."""
    next_token_ids: list[int]
    # per request, when the batch asked for logprobs
    next_token_logprobs: list[float] | None = None
    next_top_logprobs: list[list[tuple[float, int]]] | None = None
    # per request: (logprob, token) for each prompt position from its logprob start, and top-k
    input_token_logprobs: list[list[tuple[float, int]]] | None = None
    input_top_logprobs: list[list[list[tuple[float, int]]]] | None = None
    # an embedding model's pass (--is-embedding): each request's pooled vector
    embeddings: list[list[float]] | None = None


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_sum: int
    seq_lens_cpu: list[int]
    # the attention.base.AttentionBackend that RadixAttention layers call (typed loosely:
    # core imports nothing above it)
    attn_backend: Any
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    sampling_info: Any = None
    return_logprob: bool = False
    top_logprobs_nums: list[int] | None = None
    extend_logprob_start_lens: list[int] | None = None
    # DECODE: a [>= batch_size, vocab] buffer the last-token logits are written into (the CUDA
    # graph runner's, one for every captured size) instead of a fresh tensor
    logits_out: torch.Tensor | None = None
    # DECODE: last-token logits in the compute dtype, not float32 (the CUDA graphs', unless
    # RADIXSERVE_GRAPH_BF16_LOGITS=0: their argmax needs no float32 copy; layers/logits.py)
    logits_in_model_dtype: bool = False
    # ModelWorkerBatch.state_snapshots (host list)
    state_snapshots: list[tuple[int, int, int]] | None = None
    # ModelWorkerBatch.mm_inputs (host list of core.multimodal.ImageInput per request), or
    # None when no request of the pass has images
    mm_inputs: list[list[Any]] | None = None
    # [T] int32 on the device: per token of an extend pass, the index (within its request's
    # extend tokens) of the last new token it may attend to; None: causal. Set by the runner
    # for images seen both ways (core.multimodal.image_attention_limits, Gemma-3)
    extend_causal_limit: torch.Tensor | None = None
    # ModelWorkerBatch.position_offsets (host list), None when all are 0
    position_offsets: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_worker_batch(cls, batch: ModelWorkerBatch, device: torch.device,
                          attn_backend: Any) -> "ForwardBatch":
        def to_dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        seq_lens = batch.seq_lens
        if batch.forward_mode.is_decode():
            positions_cpu = batch.decode_positions()
            ext = dict()
        else:
            positions_cpu = []
            offsets = batch.position_offsets or [0] * len(seq_lens)
            for prefix_len, ext_len, shift in zip(batch.extend_prefix_lens,
                                                  batch.extend_seq_lens, offsets):
                positions_cpu.extend(range(prefix_len + shift, prefix_len + ext_len + shift))
            starts = [0]
            for ext_len in batch.extend_seq_lens[:-1]:
                starts.append(starts[-1] + ext_len)
            ext = dict(
                extend_seq_lens=to_dev(batch.extend_seq_lens),
                extend_prefix_lens=to_dev(batch.extend_prefix_lens),
                extend_start_loc=to_dev(starts),
                extend_seq_lens_cpu=list(batch.extend_seq_lens),
                extend_prefix_lens_cpu=list(batch.extend_prefix_lens),
            )
        return cls(
            forward_mode=batch.forward_mode,
            batch_size=batch.batch_size,
            input_ids=to_dev(batch.input_ids),
            positions=to_dev(positions_cpu),
            req_pool_indices=to_dev(batch.req_pool_indices),
            seq_lens=to_dev(seq_lens),
            out_cache_loc=batch.out_cache_loc.to(device, non_blocking=True),
            seq_lens_sum=sum(seq_lens),
            seq_lens_cpu=list(seq_lens),
            attn_backend=attn_backend,
            sampling_info=batch.sampling_info,
            return_logprob=batch.return_logprob,
            top_logprobs_nums=batch.top_logprobs_nums,
            extend_logprob_start_lens=batch.extend_logprob_start_lens,
            state_snapshots=batch.state_snapshots or None,
            mm_inputs=batch.mm_inputs if any(batch.mm_inputs) else None,
            position_offsets=list(batch.position_offsets) if any(batch.position_offsets)
            else None,
            **ext,
        )
