"""The MLA KV pool (DeepSeek-V2): per layer one buffer of [size + 1, 1, kv_lora_rank + rope_dim],
the compressed latent (normalised, not up-projected) followed by the rotated rope key. That is
576 values per token per layer for V2, against 2 x heads x head_dim for an MHA layout.

`store_kv(layer, loc, entry, None)` writes entries ([T, kv_lora_rank + rope_dim]);
`kv_buffers(layer)` returns (buffer,). Readers take the first `v_head_dim` values as the value.
FP8 storage uses one scale per layer for the whole entry (kv_scales()[0]).
"""
from __future__ import annotations

import torch

from radixserve.mem.kv_pool import KVCacheSpec, KVPool


class MLATokenToKVPool(KVPool):
    def __init__(self, size: int, spec: KVCacheSpec, device: str | torch.device) -> None:
        super().__init__(size, spec, device)
        if spec.num_kv_heads != 1 or spec.v_head_dim is None:
            raise ValueError("an MLA pool stores one latent entry per token (one KV head, "
                             "v_head_dim = the latent's width)")
        self.entry_dim = spec.head_dim
        self.latent_dim = spec.v_head_dim
        self.kv_buffer = [torch.zeros(size + 1, 1, spec.head_dim, dtype=self.dtype,
                                      device=self.device) for _ in range(spec.num_layers)]

    @classmethod
    def bytes_per_token(cls, spec: KVCacheSpec) -> int:
        element = torch.tensor([], dtype=spec.stored_dtype).element_size()
        return spec.num_layers * spec.head_dim * element

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor]:
        return (self.kv_buffer[layer_id],)

    def store_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor | None = None) -> None:
        """k: [T, kv_lora_rank + rope_dim] entries (v unused: the latent is the value)."""
        self.observe(layer_id, k, None)
        self.kv_buffer[layer_id][loc] = self.quantize(k.view(-1, 1, self.entry_dim),
                                                      self._scales[layer_id][0])

    def rotate_and_store_kv(self, *args, **kwargs):  # type: ignore[override]
        raise NotImplementedError("MLA layers rotate their rope part themselves")
