"""A backend that sends prefill (EXTEND, MIXED) passes to one backend and DECODE passes,
CUDA graphs included, to another. Both were built on the same context, so they read and write
the same pools: KV a prefill stored is what the decode backend reads."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.attention.base import AttentionBackend, Decompress
from radixserve.core.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.layers.rotary import RopeInput
    from radixserve.mem.kv_pool import KVStoreTarget


class HybridAttnBackend(AttentionBackend):
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        super().__init__(prefill.context)
        self.prefill_backend = prefill
        self.decode_backend = decode

    def _for(self, forward_batch: ForwardBatch) -> AttentionBackend:
        return self.decode_backend if forward_batch.forward_mode.is_decode() \
            else self.prefill_backend

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._for(forward_batch).init_forward_metadata(forward_batch)

    def kv_store_target(self, layer: "RadixAttention",
                        forward_batch: ForwardBatch) -> "KVStoreTarget | None":
        return self._for(forward_batch).kv_store_target(layer, forward_batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: "RadixAttention", forward_batch: ForwardBatch,
                rope: "RopeInput | None" = None, kv_stored: bool = False) -> torch.Tensor:
        return self._for(forward_batch).forward(q, k, v, layer, forward_batch, rope, kv_stored)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        return self.prefill_backend.forward_extend(q, k, v, layer, forward_batch)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        return self.decode_backend.forward_decode(q, k, v, layer, forward_batch)

    def forward_mla_extend(self, q: torch.Tensor, entries: torch.Tensor,
                           decompress: Decompress, layer: "RadixAttention",
                           forward_batch: ForwardBatch) -> torch.Tensor:
        return self.prefill_backend.forward_mla_extend(q, entries, decompress, layer,
                                                       forward_batch)

    def forward_mla_decode(self, q: torch.Tensor, entries: torch.Tensor,
                           layer: "RadixAttention", forward_batch: ForwardBatch) -> torch.Tensor:
        return self.decode_backend.forward_mla_decode(q, entries, layer, forward_batch)

    # ---- CUDA graphs: decode only ----
    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.decode_backend.init_cuda_graph_state(max_bs)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        self.decode_backend.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices,
                                                                     seq_lens)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int) -> None:
        self.decode_backend.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices,
                                                                    seq_lens, seq_lens_sum)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode_backend.get_cuda_graph_seq_len_fill_value()
