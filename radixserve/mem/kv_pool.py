"""The KV pool interface: token-granular storage of one KV entry per (layer, token slot).

A pool hands out KV slots (page size 1) and stores what attention needs to keep per token. What
that is depends on the attention kind, described by a `KVCacheSpec`:
  * "mha": a K and a V of [num_kv_heads, head_dim] per layer (MHA, GQA, MQA);
  * "mla": one entry of head_dim = kv_lora_rank + rope dim per layer (DeepSeek-V2): the
    compressed latent (read as the value too: `v_head_dim` = kv_lora_rank) then the rotated
    rope key; one "KV head";
  * later, quantised storage (FP8 with scales) as a `storage_dtype` other than the compute
    dtype.
Each kind is one `KVPool` subclass, registered in `KV_POOL_CLASSES`; callers go through this
interface only, so a new kind is a new class, not an edit of its callers.

Slot 0 is never handed out: it is the padding sink that padded (CUDA graph) requests write to,
so valid slots are 1..size. Allocation lives on the CPU (a scheduler decision must not sync the
device). Ownership: whoever allocates frees; the prefix cache takes ownership of the slots it
inserts and frees them on eviction.

What an attention backend needs of a pool:
  * `store_kv(layer_id, loc, k, v)`: write this pass's entries at slots `loc`;
  * `rotate_and_store_kv(...)`: rope applied to q and k and the store, fused where the pool
    has a kernel for it (the MHA pool on a Triton device); the default rotates, then stores;
  * `kv_buffers(layer_id)`: the tensors to read (for MHA: (k_buffer, v_buffer), each
    [size + 1, num_kv_heads, head_dim]);
  * `store_target(layer_id, loc)`: the buffers a producer may write this pass's K/V into
    itself (one-row decode: the q|k|v product's epilogue rotates and stores them), or None
    where the pool must store them (the default);
  * `kv_scales(layer_id)`: (k_scale, v_scale) of quantised storage (None when not quantised):
    FP8 pools (`storage_dtype` float8_e4m3fn / float8_e5m2, --kv-cache-dtype) store
    value / scale saturated to the FP8 range, and readers multiply back;
  * `bytes_per_token(spec)`: the memory one token costs in all layers, used once to size it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token's KV looks like, per layer. `storage_dtype` is what the pool holds
    (None: the compute dtype)."""
    kind: str  # "mha" | "mla"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    storage_dtype: torch.dtype | None = None
    v_head_dim: int | None = None  # the value's width when not head_dim (MLA: the latent)

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def stored_dtype(self) -> torch.dtype:
        return self.storage_dtype or self.dtype


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# --kv-cache-dtype -> storage dtype (None: the compute dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def dequantize(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored FP8 codes -> values in `dtype` (code x scale, computed in float32)."""
    return (codes.float() * scale).to(dtype)


class KVStoreTarget(NamedTuple):
    """Where a pass's new K/V rows of one layer go when a kernel other than the pool's writes
    them: k_cache / v_cache [slots, num_kv_heads, head_dim] at slots `loc`, each value stored
    as `KVPool.quantize` stores it (value / scale saturated for FP8, else cast)."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    loc: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


RotateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                    tuple[torch.Tensor, torch.Tensor]]


class PerHeadNorms(Protocol):
    """RMSNorms over each head of q and of k that come before rope (Qwen3's q_norm / k_norm;
    layers/rotary.QKNorm): a fused rope kernel takes their weights and eps, anything else
    applies them first."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float | None  # None: the two norms' eps differ (not fusable)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...


class KVPool(ABC):
    """Slot allocation (shared) plus the per-kind storage (subclasses)."""

    def __init__(self, size: int, spec: KVCacheSpec, device: str | torch.device) -> None:
        self.size = size
        self.spec = spec
        self.dtype = spec.stored_dtype
        self.layer_num = spec.num_layers
        self.device = torch.device(device)
        # kept on the CPU: allocation is a scheduler decision and must not sync the device
        self.clear()
        self._scales = [(1.0, 1.0)] * spec.num_layers
        # per layer [K amax, V amax] while calibrating (start_observing), else None
        self._observed: list[list[torch.Tensor]] | None = None

    # ---- sizing ----
    @classmethod
    @abstractmethod
    def bytes_per_token(cls, spec: KVCacheSpec) -> int:
        """Bytes one token's KV takes in all layers (what sizes the pool)."""

    # ---- slots ----
    # Free slots are a tensor to take from plus the tensors freed since: a free costs the
    # slots it frees, not a copy of the whole free list (millions of entries in a large pool,
    # and every finished request frees some). They are joined when a take needs them.
    def available_size(self) -> int:
        return self._free_head.numel() + self._freed_count

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Return `need_size` free KV slots (int64, CPU), or None if there are not enough."""
        if need_size > self.available_size():
            return None
        if need_size > self._free_head.numel():
            self._join_freed()
        taken = self._free_head[:need_size]
        self._free_head = self._free_head[need_size:]
        return taken

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        freed = self._freed
        # a copy: the caller's tensor may be a view of something it changes later
        freed.append(slots.to(device="cpu", dtype=torch.int64, copy=True))
        self._freed_count += slots.numel()
        # pieces of geometrically falling sizes (merge the last two while the newer is at
        # least half the older): the list stays O(log n) long, each slot is copied O(log n) times
        while len(freed) >= 2 and 2 * freed[-1].numel() >= freed[-2].numel():
            last = freed.pop()
            freed[-1] = torch.cat((freed[-1], last))

    def clear(self) -> None:
        self._free_head = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._freed: list[torch.Tensor] = []
        self._freed_count = 0

    def _join_freed(self) -> None:
        if self._freed:
            self._free_head = torch.cat([self._free_head, *self._freed])
            self._freed, self._freed_count = [], 0

    @property
    def free_slots(self) -> torch.Tensor:
        """Every free slot (joins what was freed since the last take)."""
        self._join_freed()
        return self._free_head

    # ---- storage ----
    @abstractmethod
    def store_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """Write this pass's entries ([T, ...] per the kind) into slots `loc` ([T]) of a layer."""

    @abstractmethod
    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, ...]:
        """The layer's storage tensors, indexed by slot, for the attention kernels to read."""

    # ---- quantised storage (FP8) ----
    @property
    def quantized(self) -> bool:
        """Whether the buffers hold FP8 codes (value = code x scale) rather than values."""
        return self.dtype in FP8_DTYPES

    def kv_scales(self, layer_id: int) -> tuple[float, float] | None:
        """(k_scale, v_scale) of a quantised layer (stored code x scale = value; per tensor per
        layer, 1.0 unless the checkpoint gave them); None when the buffers hold the values."""
        return self._scales[layer_id] if self.quantized else None

    def set_kv_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        self._scales[layer_id] = (float(k_scale), float(v_scale))

    def start_observing(self) -> None:
        """Record each layer's K and V absolute maximum in `store_kv` (FP8 calibration)."""
        self._observed = [
            [torch.zeros((), device=self.device), torch.zeros((), device=self.device)]
            for _ in range(self.layer_num)]

    def stop_observing(self) -> list[tuple[float, float]]:
        observed, self._observed = self._observed, None
        assert observed is not None, "start_observing was not called"
        return [(float(k), float(v)) for k, v in observed]

    def observe(self, layer_id: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        observed = self._observed
        if observed is None:
            return
        record = observed[layer_id]
        record[0] = torch.maximum(record[0], k.detach().abs().max().float())
        if v is not None:
            record[1] = torch.maximum(record[1], v.detach().abs().max().float())

    @property
    def observing(self) -> bool:
        return self._observed is not None

    def quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """Values -> what the buffers hold: x / scale, saturated to the FP8 range (a bare cast
        of an out-of-range value gives NaN), or x cast when not quantised."""
        if not self.quantized:
            return x.to(self.dtype)
        limit = torch.finfo(self.dtype).max
        return (x.float() * (1.0 / scale)).clamp_(-limit, limit).to(self.dtype)

    def store_target(self, layer_id: int, loc: torch.Tensor) -> KVStoreTarget | None:
        """The buffers another kernel may write this pass's K/V of `layer_id` into (at `loc`),
        or None: this pool stores them itself (the default; also while observing, which
        needs the values)."""
        return None

    def rotate_and_store_kv(self, layer_id: int, loc: torch.Tensor, q: torch.Tensor,
                            k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                            rotate: RotateFn, qk_norm: PerHeadNorms | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rope on q and k (neox layout, the given cos/sin tables), after `qk_norm` where
        given, then store k (rotated) and v. Returns the rotated q, k (possibly the inputs,
        rotated in place). The default applies the norms, calls `rotate(positions, q, k)` and
        `store_kv`; a pool with a fused kernel overrides."""
        if qk_norm is not None:
            q, k = qk_norm.apply(q, k)
        q, k = rotate(positions, q, k)
        self.store_kv(layer_id, loc, k, v)
        return q, k


def kv_pool_class(kind: str) -> type[KVPool]:
    """The pool class for a KVCacheSpec kind (imported lazily)."""
    if kind == "mha":
        from radixserve.mem.mha_pool import MHATokenToKVPool
        return MHATokenToKVPool
    if kind == "mla":
        from radixserve.mem.mla_pool import MLATokenToKVPool
        return MLATokenToKVPool
    raise ValueError(f"no KV pool for attention kind {kind!r}")


def spec_bytes_per_token(spec: KVCacheSpec) -> int:
    """Bytes one token's KV takes in all layers, as the spec's pool class counts it."""
    return kv_pool_class(spec.kind).bytes_per_token(spec)


def make_kv_pool(size: int, spec: KVCacheSpec, device: str | torch.device) -> KVPool:
    return kv_pool_class(spec.kind)(size, spec, device)
