"""The MHA/GQA KV pool: per layer a K and a V buffer of [size + 1, num_kv_heads, head_dim], in the
compute dtype or FP8 (value / scale per layer, saturated; see KVPool.quantize)."""
from __future__ import annotations

import os

import torch

from radixserve.mem.kv_pool import KVCacheSpec, KVPool, KVStoreTarget, PerHeadNorms, RotateFn

# per-head q/k norms inside the fused rope + store kernel (Qwen3); 0: applied before it
FUSE_QK_NORM = os.environ.get("RADIXSERVE_FUSE_QK_NORM", "1") != "0"


class MHATokenToKVPool(KVPool):
    def __init__(self, size: int, spec: KVCacheSpec, device: str | torch.device) -> None:
        super().__init__(size, spec, device)
        self.head_num = spec.num_kv_heads
        self.head_dim = spec.head_dim
        shape = (size + 1, spec.num_kv_heads, spec.head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                         for _ in range(spec.num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                         for _ in range(spec.num_layers)]
        try:  # looked up once: the store runs per layer per pass
            from radixserve.mem.kernels.rope_kv_store import apply_rotary_and_store_kv
            self._fused_rope_store = apply_rotary_and_store_kv
        except ImportError:  # no triton
            self._fused_rope_store = None

    @classmethod
    def bytes_per_token(cls, spec: KVCacheSpec) -> int:
        element = torch.tensor([], dtype=spec.stored_dtype).element_size()
        return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * element

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def store_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """k/v: [T, num_kv_heads * head_dim] or [T, num_kv_heads, head_dim]."""
        shape = (-1, self.head_num, self.head_dim)
        self.observe(layer_id, k, v)
        k_scale, v_scale = self._scales[layer_id]
        self.k_buffer[layer_id][loc] = self.quantize(k.view(shape), k_scale)
        self.v_buffer[layer_id][loc] = self.quantize(v.view(shape), v_scale)

    def store_target(self, layer_id: int, loc: torch.Tensor) -> KVStoreTarget | None:
        """The layer's buffers, on a Triton device (the producers that write them are Triton
        kernels) and while not observing."""
        if self._fused_rope_store is None or self.observing:
            return None
        k_scale, v_scale = self._scales[layer_id]
        return KVStoreTarget(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, k_scale,
                             v_scale)

    def rotate_and_store_kv(self, layer_id: int, loc: torch.Tensor, q: torch.Tensor,
                            k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                            rotate: RotateFn, qk_norm: PerHeadNorms | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One Triton kernel norms q and k per head (`qk_norm`, where the rope covers whole
        heads), rotates them in place and writes rotated k and v into the layer's buffers
        (instead of two norm kernels, a rotary kernel and two index_put launches). Without
        Triton, the default (norm, rotate, then store)."""
        target = self.store_target(layer_id, loc)
        if target is None:
            return super().rotate_and_store_kv(layer_id, loc, q, k, v, positions, cos_cache,
                                               sin_cache, rotate, qk_norm)
        norm_weights = None
        if qk_norm is not None:
            weights = (qk_norm.q_weight, qk_norm.k_weight)
            if FUSE_QK_NORM and qk_norm.eps is not None and \
                    cos_cache.shape[1] == self.head_dim and \
                    all(w.dtype == q.dtype and w.shape == (self.head_dim,) for w in weights):
                norm_weights = (qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps)
            else:
                q, k = qk_norm.apply(q, k)
        self._fused_rope_store(positions, q, k, v, cos_cache, sin_cache, self.head_dim,
                               target.k_cache, target.v_cache, target.loc,
                               k_scale=target.k_scale, v_scale=target.v_scale,
                               qk_norm=norm_weights)
        return q, k
