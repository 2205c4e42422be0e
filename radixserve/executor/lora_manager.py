"""LoRA adapters on a built model: slots in the adapted layers' stacks (layers/lora.py), the
adapters of --lora-paths placed in them at start-up and others loaded into free slots (and
unloaded) while serving, and before each pass the grouping of its tokens by the adapter their
request named (ModelWorkerBatch.lora_names).

The slots are made once: --max-loras of them, of rank --max-lora-rank, on the layers of
--lora-target-modules (by default what --lora-paths' adapters need), so a CUDA graph captured
with the per-row kernels stays valid as adapters come and go; an adapter of a larger rank or
on another module is refused with the reason.

An adapter's module names are the checkpoint's (q_proj, gate_proj, ...); the model's
`packed_modules_mapping` and `checkpoint_prefixes` take them to the merged layers and shard ids
the base weights load into, so a module of q|k|v or gate|up is a piece of the merged layer.

Decode steps on a GPU go to the per-row kernels (each request's slot read on the device), the
form the decode CUDA graphs capture (executor/cuda_graph_runner.py); prefill and mixed passes
use torch's products. RADIXSERVE_LORA_ROWS_KERNEL=1 / 0 turns the kernels on (the Triton
interpreter on a CPU) / off (eager torch decode steps on a GPU, and no adapter graphs).
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from radixserve.core.forward_batch import ModelWorkerBatch
from radixserve.layers.linear import LinearBase
from radixserve.layers.merged_linear import MergedColumnParallelLinear, QKVParallelLinear
from radixserve.layers.lora import LoRABatch, attach_lora, clear_lora_slot, load_lora_piece
from radixserve.loader.checkpoint_error import CheckpointError
from radixserve.loader.lora_adapter import LoRAAdapter, read_lora_adapter
from radixserve.loader.weight_loading import renamed

if TYPE_CHECKING:
    from radixserve.config import ServerArgs

logger = logging.getLogger(__name__)

# passes of at most this many tokens (decode steps without the per-row kernels, short mixes)
# take every slot's products masked: on a CPU, SmolLM2-135M shapes at batch 16 over 4 adapters
# ran 0.64-0.67x the base model's decode so and 0.45x with each adapter's rows gathered
MASKED_MAX_TOKENS = 64
# --lora-target-modules all: the projections of a decoder layer, where the model has them
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALoadError(ValueError):
    """An adapter that cannot be loaded (or unloaded) now, with the reason."""


def _pieces(layer: LinearBase) -> tuple[object, ...]:
    """The shard ids a layer's weight loads in (None: one unmerged weight)."""
    if isinstance(layer, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(layer, MergedColumnParallelLinear):
        return tuple(range(len(layer.output_sizes)))
    return (None,)


def _read_directly(layer: LinearBase) -> bool:
    """A weight the model reads itself, not through its layer, and that applies no adapter
    itself (MLA's kv_b_proj does: `applies_own_lora`)."""
    return getattr(layer, "weight_read_directly", False) and \
        not getattr(layer, "applies_own_lora", False)


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


class LoRAManager:
    """The adapter slots of one model runner: `slots` maps each loaded adapter's name to its
    slot in every adapted layer's stacks; `batch` is the pass's grouping those layers read."""

    def __init__(self, model: nn.Module, server_args: "ServerArgs", dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model, self.dtype, self.device = model, dtype, device
        self.batch = LoRABatch()
        choice = os.environ.get("RADIXSERVE_LORA_ROWS_KERNEL", "auto")
        self.rows_kernel = device.type == "cuda" if choice == "auto" else choice == "1"
        self.layers: dict[str, nn.Module] = dict(model.named_modules())
        initial = [read_lora_adapter(name, path)
                   for name, path in server_args.lora_adapters().items()]
        self.num_slots = server_args.max_loras or len(initial)
        self.max_rank = server_args.max_lora_rank or max(a.rank for a in initial)
        targets = server_args.lora_target_modules or \
            sorted({_leaf(module) for a in initial for module in a.modules}) or ["all"]
        self._attach(targets)
        # layers that apply their adapters to latent entries themselves (MLA's kv_b_proj)
        self.entry_layers = any(getattr(layer, "applies_own_lora", False) and
                                getattr(layer, "lora", None) is not None
                                for layer in self.layers.values())
        self.slots: dict[str, int] = {}  # loaded adapter -> its slot
        # a loaded adapter -> the name its cached prefixes are keyed by (Req.cache_key): one
        # loaded at run time under a name used before gets a new key, not the old KV
        self.cache_ids: dict[str, str] = {}
        self._loads = 0
        for adapter in initial:
            self._place(adapter)

    # ---- slots ----
    def _attach(self, targets: list[str]) -> None:
        """Zeroed stacks on every linear layer of a targeted checkpoint module."""
        every = set(ALL_TARGETS) if "all" in targets else set()
        wanted = every | set(targets) - {"all"}
        mapping: dict[str, tuple[str, object]] = getattr(self.model, "packed_modules_mapping",
                                                         {})
        found: set[str] = set()
        for name, layer in self.layers.items():
            if not isinstance(layer, LinearBase):
                continue
            leaf = _leaf(name)
            sources = {ckpt for ckpt, (merged, _) in mapping.items() if merged == leaf} or {leaf}
            hit = sources & wanted
            if not hit:
                continue
            if _read_directly(layer):  # fp32 routers
                if hit - every:  # named, not only reached through "all"
                    raise CheckpointError(f"LoRA: {name} is a weight the model reads directly, "
                                          "not through its layer; adapters on it are not "
                                          "supported")
                continue
            found |= hit
            attach_lora(layer, self.num_slots, self.max_rank, _pieces(layer), self.batch,
                        self.dtype, self.device)
        missing = wanted - found - every
        if missing or not found:
            raise CheckpointError(f"LoRA target modules {sorted(missing or wanted)}: not a "
                                  f"linear layer of {type(self.model).__name__}")

    def _adapted(self) -> list[nn.Module]:
        return [layer for layer in self.layers.values()
                if isinstance(layer, LinearBase) and layer.lora is not None]

    def load(self, name: str, path: str) -> None:
        """Read the adapter at `path` into a free slot under `name` (LoRALoadError: a name in
        use, no free slot, or an adapter the slots cannot take, with the reason)."""
        if name in self.slots:
            raise LoRALoadError(f"a LoRA adapter named {name!r} is loaded already")
        if len(self.slots) >= self.num_slots:
            raise LoRALoadError(f"all {self.num_slots} LoRA slots are taken (--max-loras); "
                                "unload an adapter first")
        try:
            adapter = read_lora_adapter(name, path)
        except CheckpointError as exc:
            raise LoRALoadError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a caller's folder: unreadable in any way
            raise LoRALoadError(f"LoRA adapter {name!r}: cannot read {path}: "
                                f"{type(exc).__name__}: {exc}") from None
        try:
            self._place(adapter)
        except CheckpointError as exc:
            raise LoRALoadError(str(exc)) from None
        self._loads += 1
        self.cache_ids[name] = f"{name}\x00{self._loads}"

    def unload(self, name: str) -> None:
        """Free `name`'s slot (its rows zeroed). Its requests must have finished."""
        if name not in self.slots:
            raise LoRALoadError(f"no LoRA adapter named {name!r} is loaded")
        slot = self.slots.pop(name)
        self.cache_ids.pop(name)
        for layer in self._adapted():
            clear_lora_slot(layer, slot)
        logger.info("LoRA adapter %r unloaded (slot %d)", name, slot)

    def _place(self, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise CheckpointError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, "
                                  f"above --max-lora-rank {self.max_rank}")
        targets = {module: self._target(adapter, module) for module in adapter.modules}
        slot = min(set(range(self.num_slots)) - set(self.slots.values()))
        try:
            for module, (a, b) in adapter.modules.items():
                layer, piece = targets[module]
                load_lora_piece(layer, slot, piece, a.to(self.dtype), b.to(self.dtype),
                                adapter.scale)
        except Exception as exc:  # noqa: BLE001 - tensors of any shape or dtype
            for layer in self._adapted():
                clear_lora_slot(layer, slot)
            raise CheckpointError(f"LoRA adapter {adapter.name!r}: {exc}") from None
        self.slots[adapter.name] = slot
        self.cache_ids[adapter.name] = adapter.name
        logger.info("LoRA adapter %r: rank %d, scale %g, %d modules, slot %d", adapter.name,
                    adapter.rank, adapter.scale, len(adapter.modules), slot)

    def _target(self, adapter: LoRAAdapter, module: str) -> tuple[LinearBase, object]:
        """The layer (and its shard id) that checkpoint module `module` loads into."""
        model = self.model
        name = renamed(module + ".", getattr(model, "checkpoint_prefixes", {}))[:-1]
        parent, _, last = name.rpartition(".")
        mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
        piece = None
        if last in mapping:
            merged, piece = mapping[last]
            name = f"{parent}.{merged}" if parent else merged
        layer = self.layers.get(name)
        if not isinstance(layer, LinearBase):
            raise CheckpointError(f"LoRA adapter {adapter.name!r} adapts {module!r}, which is "
                                  f"not a linear layer of {type(model).__name__}")
        if _read_directly(layer):  # fp32 routers
            raise CheckpointError(f"LoRA adapter {adapter.name!r}: {module!r} is a weight the "
                                  "model reads directly, not through its layer; adapters on it "
                                  "are not supported")
        if layer.lora is None:
            raise CheckpointError(f"LoRA adapter {adapter.name!r} adapts {module!r}, which is "
                                  "not among the LoRA target modules (--lora-target-modules)")
        return layer, piece

    # ---- passes ----
    def slot_of(self, name: str | None) -> int:
        """A request's slot in the stacks (-1: the base model)."""
        return -1 if name is None else self.slots[name]

    @contextmanager
    def capturing(self, token_slots: torch.Tensor | None) -> Iterator[None]:
        """A decode graph's capture: its layers launch the per-row kernels on `token_slots`
        (the graph's input row, refilled before each replay), or no adapter code (None)."""
        if token_slots is not None:
            self.batch.use_token_slots(token_slots, rows_kernel=True)
        try:
            yield
        finally:
            self.batch.clear()

    def prepare(self, batch: ModelWorkerBatch) -> None:
        """The pass's adapter rows (tokens per request: its extend length, or one in a decode
        step)."""
        names = batch.lora_names
        if not any(names):
            self.batch.clear()
            return
        slots = torch.tensor([self.slot_of(name) for name in names])
        if self.rows_kernel and batch.forward_mode.is_decode():
            self.batch.use_token_slots(self._to_device(slots), rows_kernel=True)
            return
        lens = batch.extend_seq_lens or [1] * batch.batch_size
        token_slots = slots.repeat_interleave(torch.tensor(lens))
        if all(name == names[0] for name in names):  # one adapter for the whole pass
            self.batch.use_single(self.slots[names[0]])
        elif len(token_slots) <= MASKED_MAX_TOKENS:
            self.batch.use_token_slots(self._to_device(token_slots), rows_kernel=False)
        else:  # each adapter's token rows: one copy of them all, sorted by slot
            order = torch.argsort(token_slots, stable=True)
            kinds, counts = torch.unique_consecutive(token_slots[order], return_counts=True)
            rows = self._to_device(order)
            groups, start = [], 0
            for slot, count in zip(kinds.tolist(), counts.tolist()):
                if slot >= 0:
                    groups.append((slot, rows[start:start + count]))
                start += count
            self.batch.use_groups(groups)
        if self.entry_layers and batch.extend_seq_lens:
            prefix = slots.repeat_interleave(torch.tensor(batch.extend_prefix_lens))
            self.batch.entry_slots = self._to_device(torch.cat((prefix, token_slots)))

    def _to_device(self, indices: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # no wait on the step in flight (overlap)
            return indices.pin_memory().to(self.device, non_blocking=True)
        return indices
