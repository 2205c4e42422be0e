"""From final hidden states to the logits the sampler needs (last token of each request) and,
when asked, the logits of every prompt position for input logprobs."""
from __future__ import annotations

from typing import NamedTuple

import torch

from radixserve.core.forward_batch import ForwardBatch
from radixserve.layers.embedding import VocabParallelEmbedding, project_to_vocab


class LogitsOutput(NamedTuple):
    # [bs, vocab] fp32; a decode graph's in the compute dtype with
    # ForwardBatch.logits_in_model_dtype
    next_token_logits: torch.Tensor
    extend_logits: torch.Tensor | None  # [T, vocab] fp32 when input logprobs were asked


def last_token_indices(forward_batch: ForwardBatch) -> torch.Tensor:
    if forward_batch.forward_mode.is_decode():
        return torch.arange(forward_batch.batch_size, device=forward_batch.input_ids.device)
    assert forward_batch.extend_start_loc is not None and forward_batch.extend_seq_lens is not None
    return forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1


def pooled_last_token(hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
    """An embedding model's output: [requests, hidden] float32, each request's last position,
    L2-normalised."""
    return torch.nn.functional.normalize(hidden[last_token_indices(forward_batch)].float(),
                                         dim=-1)


def _soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma-2's final logit soft-capping), in place on the fp32
    logits (a buffer given to project_to_vocab stays the output)."""
    return logits if cap <= 0 else logits.div_(cap).tanh_().mul_(cap)


def compute_logits(hidden: torch.Tensor, lm_head: VocabParallelEmbedding,
                   forward_batch: ForwardBatch, final_logit_cap: float = 0.0) -> LogitsOutput:
    """Logits of each request's last position (and of every position when input logprobs were
    asked), over the whole vocabulary on every tensor-parallel rank.

    A decode batch with `logits_in_model_dtype` (the CUDA graphs', unless
    RADIXSERVE_GRAPH_BF16_LOGITS=0) keeps them in the compute dtype: the graph's argmax needs
    no float32 copy of [bs, vocab], and the sampler and the logprobs convert what they read
    (a final logit cap keeps float32, which it is applied in)."""
    want_input_logprobs = (forward_batch.return_logprob
                           and forward_batch.forward_mode.is_extend()
                           and any(s >= 0 for s in forward_batch.extend_logprob_start_lens or []))
    if want_input_logprobs:
        all_logits = _soft_cap(project_to_vocab(hidden, lm_head), final_logit_cap)
        return LogitsOutput(all_logits[last_token_indices(forward_batch)], all_logits)
    # decode: one row per request already
    last = hidden if forward_batch.forward_mode.is_decode() else \
        hidden[last_token_indices(forward_batch)]
    decode = forward_batch.forward_mode.is_decode()
    logits = project_to_vocab(last, lm_head, forward_batch.logits_out if decode else None,
                              keep_dtype=decode and forward_batch.logits_in_model_dtype
                              and final_logit_cap <= 0)
    return LogitsOutput(_soft_cap(logits, final_logit_cap), None)
