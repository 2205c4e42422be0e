"""LoRA adapters on the linear layers (--lora-paths): each request may name an adapter, and
every adapted linear adds scale * (x A^T) B^T for that request's rows to its output, where A is
[r, in] and B [out, r] (PEFT's lora_A / lora_B), scale = lora_alpha / r (lora_alpha / sqrt(r)
with rsLoRA).

Every adapter lives in a slot of stacks on the layer, loaded once at start-up:
  * `lora_a` [slots, pieces x r_max, in]: a merged layer (q|k|v, gate|up) holds one A per piece,
    piece p in rows p * r_max ..; a smaller rank leaves zero rows;
  * `lora_b` [slots, out, pieces x r_max]: piece p's B in its own output rows (placed by the
    layer's own weight loader, so tensor-parallel slices and replicated KV heads come out as
    the base weight's) and in columns p * r_max ..: block-diagonal, so one pair of products
    serves every piece;
  * `lora_scale` [slots].
Under tensor parallelism a column-parallel layer keeps A whole and B's rows of this rank; a
row-parallel one A's columns of this rank and B whole, and its delta joins the partial product
before the all-reduce (the sum over ranks of x_r A_r^T is x A^T).

The pass's grouping (`LoRABatch`: for each adapter slot present, the token rows that take it)
is shared by every adapted layer of the model and set before each forward by
executor/lora_manager.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRABatch:
    """The current pass's token rows per adapter slot (rows without an adapter are in none)."""
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass
class LoRAStacks:
    a: torch.Tensor  # [slots, pieces x r_max, in]
    b: torch.Tensor  # [slots, out, pieces x r_max]
    scale: list[float]  # per slot
    pieces: tuple[object, ...]  # the layer's shard ids (None: one unmerged weight)
    r_max: int
    batch: LoRABatch


def attach_lora(layer: torch.nn.Module, slots: int, r_max: int, pieces: tuple[object, ...],
                batch: LoRABatch, dtype: torch.dtype, device: torch.device) -> LoRAStacks:
    """Zeroed stacks for `slots` adapters of rank <= r_max on a linear layer."""
    width = len(pieces) * r_max
    stacks = LoRAStacks(
        a=torch.zeros(slots, width, layer.input_size, dtype=dtype, device=device),
        b=torch.zeros(slots, layer.output_size, width, dtype=dtype, device=device),
        scale=[0.0] * slots, pieces=pieces, r_max=r_max, batch=batch)
    layer.lora = stacks
    return stacks


def load_lora_piece(layer: torch.nn.Module, slot: int, piece: object, a: torch.Tensor,
                    b: torch.Tensor) -> None:
    """One adapter's A [r, in] and B [out, r] for one piece of the layer, into `slot`."""
    stacks: LoRAStacks = layer.lora
    if piece not in stacks.pieces:
        raise ValueError(f"{type(layer).__name__} has no piece {piece!r}")
    rank = a.shape[0]
    if b.shape[1] != rank or rank > stacks.r_max:
        raise ValueError(f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not make a "
                         f"rank <= {stacks.r_max} pair")
    start = stacks.pieces.index(piece) * stacks.r_max
    a_rows = stacks.a[slot, start:start + rank]
    if layer.input_is_split and layer.tp_size > 1:  # this rank's input columns
        part = a.shape[1] // layer.tp_size
        a = a.narrow(1, layer.tp_rank * part, part)
    if a.shape != a_rows.shape:
        raise ValueError(f"lora_A of shape {tuple(a.shape)} does not fit {tuple(a_rows.shape)}")
    a_rows.copy_(a)
    b_columns = torch.nn.Parameter(stacks.b[slot, :, start:start + rank], requires_grad=False)
    if layer.input_is_split:  # row-parallel: B whole on every rank
        b_columns.data.copy_(b)
    elif piece is None:
        layer.weight_loader(b_columns, b)
    else:
        layer.weight_loader(b_columns, b, piece)


def add_lora(layer: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (x's product with the layer's own weight, [tokens, out]) plus each adapted row's
    delta; a pass without adapters returns out as it is."""
    stacks: LoRAStacks = layer.lora
    if not stacks.batch.groups:
        return out
    x2 = x.reshape(-1, x.shape[-1])
    out2 = out.reshape(-1, out.shape[-1])
    for slot, rows in stacks.batch.groups:
        low = x2.index_select(0, rows) @ stacks.a[slot].t()
        delta = (low @ stacks.b[slot].t()) * stacks.scale[slot]
        out2.index_add_(0, rows, delta.to(out2.dtype))
    return out
