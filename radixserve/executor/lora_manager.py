"""The LoRA adapters of --lora-paths on a built model: every adapter read at start-up and placed
in its slot of the adapted layers' stacks (layers/lora.py), and before each pass the grouping of
its tokens by the adapter their request named (ModelWorkerBatch.lora_names).

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
from typing import Iterator

import torch
from torch import nn

from radixserve.core.forward_batch import ModelWorkerBatch
from radixserve.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from radixserve.layers.lora import LoRABatch, attach_lora, load_lora_piece
from radixserve.layers.recurrent_mixer import RecurrentMixer
from radixserve.loader.checkpoint_error import CheckpointError
from radixserve.loader.lora_adapter import LoRAAdapter, read_lora_adapter
from radixserve.loader.weight_loading import renamed

logger = logging.getLogger(__name__)


def _pieces(layer: LinearBase) -> tuple[object, ...]:
    """The shard ids a layer's weight loads in (None: one unmerged weight)."""
    if isinstance(layer, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(layer, MergedColumnParallelLinear):
        return tuple(range(len(layer.output_sizes)))
    return (None,)


class LoRAManager:
    """The adapters of one model runner: `slots` maps each name to its slot in every adapted
    layer's stacks; `batch` is the pass's grouping those layers read."""

    def __init__(self, model: nn.Module, adapter_paths: dict[str, str], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slots = {name: slot for slot, name in enumerate(adapter_paths)}
        self.batch = LoRABatch()
        self.device = device
        choice = os.environ.get("RADIXSERVE_LORA_ROWS_KERNEL", "auto")
        self.rows_kernel = device.type == "cuda" if choice == "auto" else choice == "1"
        if any(isinstance(m, RecurrentMixer) for m in model.modules()):
            raise ValueError("LoRA adapters on hybrid (recurrent-mixer) models are not "
                             "supported yet")
        adapters = [read_lora_adapter(name, path) for name, path in adapter_paths.items()]
        r_max = max(adapter.rank for adapter in adapters)
        layers: dict[str, nn.Module] = dict(model.named_modules())
        for slot, adapter in enumerate(adapters):
            for module, (a, b) in adapter.modules.items():
                layer, piece = self._target(model, layers, adapter, module)
                if layer.lora is None:
                    attach_lora(layer, len(adapters), r_max, _pieces(layer), self.batch,
                                dtype, device)
                load_lora_piece(layer, slot, piece, a.to(dtype), b.to(dtype), adapter.scale)
            logger.info("LoRA adapter %r: rank %d, scale %g, %d modules", adapter.name,
                        adapter.rank, adapter.scale, len(adapter.modules))

    @staticmethod
    def _target(model: nn.Module, layers: dict[str, nn.Module], adapter: LoRAAdapter,
                module: str) -> tuple[LinearBase, object]:
        """The layer (and its shard id) that checkpoint module `module` loads into."""
        name = renamed(module + ".", getattr(model, "checkpoint_prefixes", {}))[:-1]
        parent, _, last = name.rpartition(".")
        mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
        piece = None
        if last in mapping:
            merged, piece = mapping[last]
            name = f"{parent}.{merged}" if parent else merged
        layer = layers.get(name)
        if not isinstance(layer, LinearBase):
            raise CheckpointError(f"LoRA adapter {adapter.name!r} adapts {module!r}, which is "
                                  f"not a linear layer of {type(model).__name__}")
        if getattr(layer, "weight_read_directly", False):  # MLA's kv_b_proj, fp32 routers
            raise CheckpointError(f"LoRA adapter {adapter.name!r}: {module!r} is a weight the "
                                  "model reads directly, not through its layer; adapters on it "
                                  "are not supported")
        return layer, piece

    def slot_of(self, name: str | None) -> int:
        """A request's slot in the stacks (-1: the base model)."""
        return -1 if name is None else self.slots[name]

    @contextmanager
    def capturing(self, token_slots: torch.Tensor | None) -> Iterator[None]:
        """A decode graph's capture: its layers launch the per-row kernels on `token_slots`
        (the graph's input row, refilled before each replay), or no adapter code (None)."""
        self.batch.set(None, token_slots, rows_kernel=token_slots is not None)
        try:
            yield
        finally:
            self.batch.set(None, None)

    def prepare(self, batch: ModelWorkerBatch) -> None:
        """Each token's adapter slot for the pass (tokens per request: its extend length, or
        one in a decode step)."""
        names = batch.lora_names
        if not any(names):
            self.batch.set(None, None)
        elif self.rows_kernel and batch.forward_mode.is_decode():
            slots = torch.tensor([self.slot_of(name) for name in names])
            self.batch.set(None, self._to_device(slots), rows_kernel=True)
        elif all(name == names[0] for name in names):  # one adapter for the whole pass
            self.batch.set(self.slots[names[0]], None)
        else:
            lens = batch.extend_seq_lens or [1] * batch.batch_size
            slots = torch.tensor([self.slot_of(name) for name in names])
            self.batch.set(None, self._to_device(slots.repeat_interleave(torch.tensor(lens))))

    def _to_device(self, slots: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # no wait on the step in flight (overlap)
            return slots.pin_memory().to(self.device, non_blocking=True)
        return slots
