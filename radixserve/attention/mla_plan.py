"""Where an MLA extend pass finds each request's cached prefix (built once per pass, read by
every layer).

An extend pass of an MLA model decompresses, per layer, the latent entries of every request's
whole sequence: the cached prefix (read from the pool at `prefix_slots`) followed by this pass's
new tokens. The decompressed keys/values are laid out [all prefixes, request after request | all
new tokens, as the pass packs them], so the new tokens' part is the pass's own layout and the
prefix part is addressed through `prefix_table` (request i's position j -> row
prefix_start[i] + j), the shape of a req_to_token table, with `rows` as the request indices.
Built on the device from host lengths only: no sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.core.forward_batch import ForwardBatch


@dataclass
class MLAExtendPlan:
    num_prefix_tokens: int
    prefix_slots: torch.Tensor  # [P] int64 KV slots of the cached prefixes, request after request
    prefix_table: torch.Tensor  # [bs, max(1, max prefix)] int32 row of (request, position)
    rows: torch.Tensor  # [bs] int64, arange: request i uses row i of prefix_table
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]


def build_mla_extend_plan(forward_batch: ForwardBatch, req_to_token: torch.Tensor
                          ) -> MLAExtendPlan:
    prefix_lens = forward_batch.extend_prefix_lens_cpu
    extend_lens = forward_batch.extend_seq_lens_cpu
    assert prefix_lens is not None and extend_lens is not None, "an extend pass"
    device = forward_batch.input_ids.device
    bs = len(prefix_lens)
    total = sum(prefix_lens)
    max_prefix = max(prefix_lens, default=0)
    starts = [0]
    for n in prefix_lens[:-1]:
        starts.append(starts[-1] + n)
    starts_dev = torch.tensor(starts, dtype=torch.int64, device=device)
    rows = torch.arange(bs, dtype=torch.int64, device=device)
    table = (starts_dev[:, None] + torch.arange(max(1, max_prefix), device=device)[None, :])
    if total == 0:
        slots = torch.zeros(0, dtype=torch.int64, device=device)
    else:
        lens_dev = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
        owner = torch.repeat_interleave(rows, lens_dev, output_size=total)
        position = torch.arange(total, device=device) - starts_dev[owner]
        req_rows = forward_batch.req_pool_indices.to(torch.int64)[owner]
        slots = req_to_token[req_rows, position].to(torch.int64)
    return MLAExtendPlan(total, slots, table.to(torch.int32), rows, list(prefix_lens),
                         list(extend_lens))
