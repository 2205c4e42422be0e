"""LoRA adapters on the linear layers (--lora-paths): each request may name an adapter, and
every adapted linear adds scale * (x A^T) B^T for that request's rows to its output, where A is
[r, in] and B [out, r] (PEFT's lora_A / lora_B), scale = lora_alpha / r (lora_alpha / sqrt(r)
with rsLoRA).

Every adapter lives in a slot of two stacks on the layer, loaded once at start-up (width =
pieces x r_max, slot s in the s-th `width` rows / columns):
  * `a` [slots x width, in]: a merged layer (q|k|v, gate|up) holds one A per piece, piece p in
    rows p * r_max .. of its slot; a smaller rank leaves zero rows;
  * `b` [out, slots x width]: piece p's B times the adapter's scale in its own output rows
    (placed by the layer's own weight loader, so tensor-parallel slices and replicated KV
    heads come out as the base weight's) and in columns p * r_max .. of its slot:
    block-diagonal, so one pair of products serves every piece.
Under tensor parallelism a column-parallel layer keeps A whole and B's rows of this rank; a
row-parallel one A's columns of this rank and B whole, and its delta joins the partial product
before the all-reduce (the sum over ranks of x_r A_r^T is x A^T).

The pass's adapters (`LoRABatch`: one slot for every token, or each token's slot) are shared
by every adapted layer of the model and set before each forward by
executor/lora_manager.py. Each token's slot goes to one of two forms of the products: torch's
(one adapter: its A and B; several: every slot's low-rank product, masked) or, for decode steps
on a GPU and in every CUDA graph (`rows_kernel`), the per-row Triton kernels of
layers/kernels/lora_rows.py, which read each token's slot on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.layers.kernels.lora_rows import add_lora_rows


@dataclass
class LoRABatch:
    """The current pass's adapters: `single`, the slot of every token when they all share one,
    else `token_slots` (each token's slot, -1 without an adapter), or neither (no adapter).
    `rows_kernel`: token_slots go to the per-row kernels (a device tensor a CUDA graph may
    hold: its values change between replays, the launches do not)."""
    single: int | None = None
    token_slots: torch.Tensor | None = None
    rows_kernel: bool = False
    _masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def set(self, single: int | None, token_slots: torch.Tensor | None,
            rows_kernel: bool = False) -> None:
        assert not rows_kernel or token_slots is not None
        self.single, self.token_slots, self.rows_kernel = single, token_slots, rows_kernel
        self._masks = {}

    def mask(self, slots: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, slots x width]: 1 where a column belongs to the token's adapter (each slot
        owns `width` consecutive columns), built once per pass and layer width."""
        key = (slots, width, dtype)
        if key not in self._masks:
            assert self.token_slots is not None
            columns = torch.arange(slots * width, device=self.token_slots.device) // width
            self._masks[key] = (self.token_slots[:, None] == columns[None, :]).to(dtype)
        return self._masks[key]


@dataclass
class LoRAStacks:
    a: torch.Tensor  # [slots x width, in]: slot s's A in rows s * width ..
    b: torch.Tensor  # [out, slots x width]: slot s's B (scale folded in) in columns s * width ..
    pieces: tuple[object, ...]  # the layer's shard ids (None: one unmerged weight)
    r_max: int
    batch: LoRABatch

    @property
    def width(self) -> int:
        """Columns (of B; rows of A) a slot owns: pieces x r_max."""
        return len(self.pieces) * self.r_max

    @property
    def slots(self) -> int:
        return self.a.shape[0] // self.width


def attach_lora(layer: torch.nn.Module, slots: int, r_max: int, pieces: tuple[object, ...],
                batch: LoRABatch, dtype: torch.dtype, device: torch.device) -> LoRAStacks:
    """Zeroed stacks for `slots` adapters of rank <= r_max on a linear layer."""
    width = len(pieces) * r_max
    stacks = LoRAStacks(
        a=torch.zeros(slots * width, layer.input_size, dtype=dtype, device=device),
        b=torch.zeros(layer.output_size, slots * width, dtype=dtype, device=device),
        pieces=pieces, r_max=r_max, batch=batch)
    layer.lora = stacks
    return stacks


def clear_lora_slot(layer: torch.nn.Module, slot: int) -> None:
    """Zero `slot`'s A rows and B columns (an adapter unloaded, or one about to load there:
    a smaller rank leaves rows of the last one otherwise)."""
    stacks: LoRAStacks = layer.lora
    cols = slice(slot * stacks.width, (slot + 1) * stacks.width)
    stacks.a[cols].zero_()
    stacks.b[:, cols].zero_()


def load_lora_piece(layer: torch.nn.Module, slot: int, piece: object, a: torch.Tensor,
                    b: torch.Tensor, scale: float) -> None:
    """One adapter's A [r, in] and B [out, r] for one piece of the layer, into `slot` (B
    times the adapter's scale)."""
    stacks: LoRAStacks = layer.lora
    if piece not in stacks.pieces:
        raise ValueError(f"{type(layer).__name__} has no piece {piece!r}")
    rank = a.shape[0]
    if b.shape[1] != rank or rank > stacks.r_max:
        raise ValueError(f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not make a "
                         f"rank <= {stacks.r_max} pair")
    start = slot * stacks.width + stacks.pieces.index(piece) * stacks.r_max
    a_rows = torch.nn.Parameter(stacks.a[start:start + rank], requires_grad=False)
    b_columns = torch.nn.Parameter(stacks.b[:, start:start + rank], requires_grad=False)
    b = b * scale
    if layer.input_is_split:  # row-parallel: A's columns of this rank (the layer's own split)
        layer.weight_loader(a_rows, a)
        b_columns.data.copy_(b)  # and B whole on every rank
        return
    if a.shape != a_rows.shape:  # column-parallel: A whole on every rank
        raise ValueError(f"lora_A of shape {tuple(a.shape)} does not fit {tuple(a_rows.shape)}")
    a_rows.data.copy_(a)
    if piece is None:
        layer.weight_loader(b_columns, b)
    else:
        layer.weight_loader(b_columns, b, piece)


def add_lora(layer: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (x's product with the layer's own weight, [tokens, out]: bf16, FP8 or int4 codes
    alike, the adapters' A and B stay in the compute dtype) plus the adapters' deltas: in
    `rows_kernel` passes the per-row kernels; else with one adapter for the pass, that slot's
    A and B alone; with several (or some tokens on none), every slot's low-rank products at
    once, each token's row masked to its own slot's columns before B: three operations
    whatever the mix (the products of the other slots' columns are the price, small next to
    the layer's own at the ranks adapters use)."""
    stacks: LoRAStacks = layer.lora
    batch = stacks.batch
    if batch.single is None and batch.token_slots is None:
        return out
    x2 = x.reshape(-1, x.shape[-1])
    out2 = out.reshape(-1, out.shape[-1])
    if batch.rows_kernel:
        assert batch.token_slots is not None and out2.data_ptr() == out.data_ptr()
        add_lora_rows(x2, stacks.a, stacks.b, batch.token_slots, stacks.width, out2)
        return out
    if batch.single is not None:
        cols = slice(batch.single * stacks.width, (batch.single + 1) * stacks.width)
        out2.addmm_(x2 @ stacks.a[cols].t(), stacks.b[:, cols].t())
        return out
    low = x2 @ stacks.a.t()
    low.mul_(batch.mask(stacks.slots, stacks.width, low.dtype))
    out2.addmm_(low, stacks.b.t())
    return out
