"""Turning a list of Reqs into a ModelWorkerBatch: slot allocation and req_to_token writes.

The BatchBuilder records every slot the scheduler allocates in the request table (through
ReqToTokenPool's methods); the only other writers are the radix cache (pointing duplicates at
its own slots) and the DECODE pass (the device half of a decode step's slots).

Every request in a batch has `kv_len` (KV positions written so far) tracked by the scheduler
through `req.kv_len`; extend writes [prefix_len, prefix_len + extend_len), decode one position.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixserve.core.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.core.req import Req
from radixserve.executor.sampling_info import SamplingBatchInfo
from radixserve.scheduler.grammar.vocab_mask import batch_vocab_mask

if TYPE_CHECKING:
    from radixserve.mem.base_cache import BasePrefixCache
    from radixserve.mem.kv_pool import KVPool
    from radixserve.mem.req_to_token_pool import ReqToTokenPool


class OutOfMemoryError(RuntimeError):
    """Raised when KV slots cannot be had even after eviction (an admission bug)."""


def alloc_kv(num_tokens: int, token_to_kv_pool: "KVPool",
             tree_cache: "BasePrefixCache") -> torch.Tensor:
    slots = token_to_kv_pool.alloc(num_tokens)
    if slots is None:
        tree_cache.evict(num_tokens - token_to_kv_pool.available_size())
        slots = token_to_kv_pool.alloc(num_tokens)
    if slots is None:
        raise OutOfMemoryError(f"need {num_tokens} KV slots, "
                               f"{token_to_kv_pool.available_size()} free after eviction")
    return slots


def wants_prompt_logprobs(req: Req) -> bool:
    """The request asks for its prompt tokens' logprobs in this pass (assembled on the host)."""
    return req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids


class BatchBuilder:
    def __init__(self, req_to_token_pool: "ReqToTokenPool", token_to_kv_pool: "KVPool",
                 tree_cache: "BasePrefixCache", vocab_size: int, eos_token_ids: set[int],
                 device: torch.device) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.tree_cache = tree_cache
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device

    def sampling_info(self, reqs: list[Req]) -> SamplingBatchInfo:
        """The batch's sampling tensors, with the grammars' token mask for this step."""
        info = SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.device,
                                           self.eos_token_ids)
        info.vocab_mask = batch_vocab_mask(reqs, self.vocab_size, self.device)
        return info

    def prepare_extend(self, reqs: list[Req], forward_mode: ForwardMode = ForwardMode.EXTEND,
                       with_sampling: bool = True) -> ModelWorkerBatch:
        """Allocate rows and KV slots for the requests' extend tokens (prefix already locked).
        `with_sampling=False` leaves sampling_info empty (a part of a MIXED pass)."""
        new_rows = [r for r in reqs if r.req_pool_idx is None]
        writes: list[tuple[int, int, torch.Tensor]] = []  # the table's rows, one copy for all
        if new_rows:
            rows = self.req_to_token_pool.alloc(len(new_rows))
            if rows is None:
                raise OutOfMemoryError("no free request slot (admission should prevent this)")
            for req, row in zip(new_rows, rows):
                req.req_pool_idx = row
                writes.append((row, 0, req.prefix_indices))
            resumed = [r for r in new_rows if len(r.prefix_indices)]
            self.tree_cache.restore_states([r.req_pool_idx for r in resumed],  # type: ignore
                                           [r.cache_handle for r in resumed])
        extend_lens = [r.extend_input_len for r in reqs]
        out_cache_loc = alloc_kv(sum(extend_lens), self.token_to_kv_pool, self.tree_cache)
        input_ids: list[int] = []
        offset = 0
        for req, ext_len in zip(reqs, extend_lens):
            prefix_len = len(req.prefix_indices)
            assert req.req_pool_idx is not None
            writes.append((req.req_pool_idx, prefix_len, out_cache_loc[offset:offset + ext_len]))
            input_ids.extend(req.fill_ids[prefix_len:prefix_len + ext_len])
            req.kv_len = prefix_len + ext_len
            offset += ext_len
        self.req_to_token_pool.write_many(writes)
        return_logprob = any(r.return_logprob for r in reqs)
        batch = ModelWorkerBatch(
            forward_mode=forward_mode,
            input_ids=input_ids,
            req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
            seq_lens=[r.kv_len for r in reqs],
            out_cache_loc=out_cache_loc,
            extend_seq_lens=extend_lens,
            extend_prefix_lens=[len(r.prefix_indices) for r in reqs],
            sampling_info=self.sampling_info(reqs) if with_sampling else None,
            return_logprob=return_logprob,
            top_logprobs_nums=[r.top_logprobs_num for r in reqs],
            lora_names=[r.lora_name for r in reqs],
            mm_inputs=images_in_pass(reqs, extend_lens),
            position_offsets=rope_shifts(reqs, [len(r.prefix_indices) for r in reqs]),
        )
        if return_logprob:
            self._add_input_logprob_targets(batch, reqs)
        batch.state_snapshots = self.tree_cache.reserve_prompt_snapshots(reqs)
        return batch

    @staticmethod
    def _add_input_logprob_targets(batch: ModelWorkerBatch, reqs: list[Req]) -> None:
        for req, ext_len in zip(reqs, batch.extend_seq_lens):
            prefix_len = len(req.prefix_indices)
            want = wants_prompt_logprobs(req)
            start = max(req.logprob_start_len - prefix_len, 0) if want else -1
            # targets: the prompt token after each extend position, up to the prompt's end
            end = min(prefix_len + ext_len + 1, len(req.origin_input_ids))
            batch.extend_logprob_start_lens.append(start)
            batch.extend_next_token_ids.append(req.origin_input_ids[prefix_len + 1:end]
                                               if want else [])

    def prepare_decode(self, reqs: list[Req], with_sampling: bool = True,
                       for_mixed: bool = False) -> ModelWorkerBatch:
        """One new KV slot per request for its last sampled token (memory already checked).

        A DECODE pass writes the slot into the device table itself (ReqToTokenPool.
        write_decode_slots, inside the CUDA graph when one is replayed), so only the host copy
        is written here; `for_mixed`: the batch runs as the decode part of a MIXED pass, which
        does not, so both are written here."""
        out_cache_loc = alloc_kv(len(reqs), self.token_to_kv_pool, self.tree_cache)
        rows, positions = [r.req_pool_idx for r in reqs], [r.kv_len for r in reqs]
        if for_mixed:
            self.req_to_token_pool.write_positions(rows, positions, out_cache_loc)  # type: ignore[arg-type]
        else:
            self.req_to_token_pool.write_host_positions(rows, positions,  # type: ignore[arg-type]
                                                        out_cache_loc)
        for req in reqs:
            req.kv_len += 1
        return ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=[r.output_ids[-1] for r in reqs],
            req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
            seq_lens=[r.kv_len for r in reqs],
            out_cache_loc=out_cache_loc,
            sampling_info=self.sampling_info(reqs) if with_sampling else None,
            return_logprob=any(r.return_logprob for r in reqs),
            top_logprobs_nums=[r.top_logprobs_num for r in reqs],
            lora_names=[r.lora_name for r in reqs],
            position_offsets=rope_shifts(reqs, [r.kv_len for r in reqs]),
        )


def merge_mixed(extend: ModelWorkerBatch, decode: ModelWorkerBatch,
                sampling_info: SamplingBatchInfo) -> ModelWorkerBatch:
    """One MIXED pass: the extend requests first, then each decode request as an extend of one
    token on top of its whole sequence."""
    return ModelWorkerBatch(
        forward_mode=ForwardMode.MIXED,
        input_ids=extend.input_ids + decode.input_ids,
        req_pool_indices=extend.req_pool_indices + decode.req_pool_indices,
        seq_lens=extend.seq_lens + decode.seq_lens,
        out_cache_loc=torch.cat((extend.out_cache_loc, decode.out_cache_loc)),
        extend_seq_lens=extend.extend_seq_lens + [1] * decode.batch_size,
        extend_prefix_lens=extend.extend_prefix_lens + [s - 1 for s in decode.seq_lens],
        sampling_info=sampling_info,
        top_logprobs_nums=extend.top_logprobs_nums + decode.top_logprobs_nums,
        state_snapshots=extend.state_snapshots,  # the extend requests keep their indices
        lora_names=extend.lora_names + decode.lora_names,
        mm_inputs=extend.mm_inputs + [[]] * decode.batch_size if extend.mm_inputs else [],
        position_offsets=(extend.position_offsets or [0] * extend.batch_size) +
        (decode.position_offsets or [0] * decode.batch_size)
        if extend.position_offsets or decode.position_offsets else [],
    )


def rope_shifts(reqs: list[Req], starts: list[int]) -> list[int]:
    """Per request, the shift of its rope positions at token index `starts[i]`
    (`Req.rope_shift`); empty when every one is 0 (no M-RoPE image among them, none on
    LongRoPE's long table)."""
    if not any(r.mm_inputs or r.rope_table_shift for r in reqs):
        return []
    shifts = [r.rope_shift(start) for r, start in zip(reqs, starts)]
    return shifts if any(shifts) else []


def images_in_pass(reqs: list[Req], extend_lens: list[int]) -> list[list[Any]]:
    """Per request, its images whose placeholders the pass's tokens cover (all empty: [])."""
    images: list[list[Any]] = []
    for req, ext_len in zip(reqs, extend_lens):
        start = len(req.prefix_indices)
        images.append([image for image in req.mm_inputs
                       if image.offset < start + ext_len and image.end > start])
    return images if any(images) else []
