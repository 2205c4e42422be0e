"""Drive a ModelRunner directly (no scheduler): allocate slots and build worker batches."""
from __future__ import annotations

from typing import Any

import torch

from radixserve.core.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.executor.model_runner import ModelRunner


class RunnerDriver:
    """One sequence per request row; extend and decode by hand, returning logits."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.rows: dict[int, int] = {}  # request key -> req pool row
        self.lens: dict[int, int] = {}
        # LongRoPE (core/long_rope.py): request key -> its table's first row, chosen by its
        # length after its first extend (the driver moves no request between tables)
        self.rope_tables: dict[int, int] = {}

    def extend(self, tokens_by_req: dict[int, list[int]],
               forward_mode: ForwardMode | None = None,
               mm_inputs: dict[int, list[Any]] | None = None,
               position_offsets: dict[int, int] | None = None) -> torch.Tensor:
        """Append tokens to each request (new requests start empty); last-token logits.
        mm_inputs: per request key, the images (core.multimodal.ImageInput) of its prompt;
        position_offsets: per request key, what its positions add to its token indices
        (ModelWorkerBatch.position_offsets; M-RoPE images' shifts)."""
        runner = self.runner
        prefix_lens, ext_lens, input_ids, rows = [], [], [], []
        for key, tokens in tokens_by_req.items():
            if key not in self.rows:
                self.rows[key] = runner.req_to_token_pool.alloc(1)[0]
                self.lens[key] = 0
            prefix_lens.append(self.lens[key])
            ext_lens.append(len(tokens))
            input_ids += tokens
            rows.append(self.rows[key])
        out_loc = runner.token_to_kv_pool.alloc(len(input_ids))
        offset = 0
        for key, ext_len, prefix_len in zip(tokens_by_req, ext_lens, prefix_lens):
            runner.req_to_token_pool.write(self.rows[key], prefix_len,
                                           out_loc[offset:offset + ext_len])
            self.lens[key] += ext_len
            offset += ext_len
        offsets = {k: (position_offsets or {}).get(k, 0) + self._rope_table(k)
                   for k in tokens_by_req}
        single_token = all(n == 1 for n in ext_lens) and all(p > 0 for p in prefix_lens)
        if forward_mode is None:
            forward_mode = ForwardMode.DECODE if single_token else ForwardMode.EXTEND
        batch = ModelWorkerBatch(
            forward_mode=forward_mode,
            input_ids=input_ids, req_pool_indices=rows,
            seq_lens=[self.lens[k] for k in tokens_by_req], out_cache_loc=out_loc,
            extend_seq_lens=ext_lens, extend_prefix_lens=prefix_lens,
            mm_inputs=[mm_inputs.get(k, []) for k in tokens_by_req] if mm_inputs else [],
            position_offsets=[offsets[k] for k in tokens_by_req] if any(offsets.values())
            else [])
        return runner.forward_logits(batch).next_token_logits

    def _rope_table(self, key: int) -> int:
        """The LongRoPE table shift of a request at its current length (0 without LongRoPE)."""
        switch = self.runner.long_rope
        if switch is None:
            return 0
        if key not in self.rope_tables:
            self.rope_tables[key] = switch.long_table_row if switch.wants_long(self.lens[key]) \
                else 0
        if not self.rope_tables[key] and switch.wants_long(self.lens[key]):
            raise ValueError("the driver does not move a request to LongRoPE's long table")
        return self.rope_tables[key]
