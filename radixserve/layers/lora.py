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
executor/lora_manager.py. The products take torch's forms (one adapter: its A and B; several:
each adapter's rows gathered, or in passes of a few tokens every slot's products masked) or, for
decode steps on a GPU and in every CUDA graph, the per-row Triton kernels of
layers/kernels/lora_rows.py, which read each token's slot on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.layers.kernels.lora_rows import add_lora_rows


@dataclass
class LoRABatch:
    """The current pass's adapters, in one of four forms (none set: no adapter):
      * `single`: the slot of every token, when they all share one;
      * `groups`: (slot, the rows of x on it, a device index tensor) for each adapter of the
        pass, tokens without an adapter in none (passes of many tokens);
      * `token_slots`: each token's slot (-1: none) on the device, with `rows_kernel` for the
        per-row kernels (a tensor a CUDA graph may hold: its values change between replays,
        the launches do not), else for every slot's products masked to each token's own
        (passes of a few tokens, where the count of operations costs more than the
        products)."""
    single: int | None = None
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    token_slots: torch.Tensor | None = None
    rows_kernel: bool = False
    # an MLA extend pass: the slot of each latent entry it decompresses (every request's cached
    # prefix, then the new tokens), for layers that apply their adapter themselves
    entry_slots: torch.Tensor | None = None
    _masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def clear(self) -> None:
        self.single, self.groups, self.token_slots, self.rows_kernel = None, [], None, False
        self.entry_slots, self._masks = None, {}

    def use_single(self, slot: int) -> None:
        self.clear()
        self.single = slot

    def use_groups(self, groups: list[tuple[int, torch.Tensor]]) -> None:
        self.clear()
        self.groups = groups

    def use_token_slots(self, token_slots: torch.Tensor, rows_kernel: bool) -> None:
        self.clear()
        self.token_slots, self.rows_kernel = token_slots, rows_kernel

    def mask(self, slots: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, slots x width]: 1 where a column belongs to the token's adapter (each slot
        owns `width` consecutive columns), built once per pass and layer width; built anew
        by every call for the per-row kernels' slots (a CUDA graph's row: the capture must
        record the mask's own operations on it, not reuse a tensor a warm-up made)."""
        assert self.token_slots is not None
        if self.rows_kernel:
            return _slot_mask(self.token_slots, slots, width, dtype)
        key = (slots, width, dtype)
        if key not in self._masks:
            self._masks[key] = _slot_mask(self.token_slots, slots, width, dtype)
        return self._masks[key]

    def any_form_mask(self, tokens: int, slots: int, width: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor | None:
        """`mask` whatever the pass's form (None: no adapter)."""
        if self.token_slots is not None:
            return self.mask(slots, width, dtype)
        if self.single is None and not self.groups:
            return None
        token_slots = torch.full((tokens,), -1 if self.groups else self.single,
                                 dtype=torch.int64, device=device)
        for slot, rows in self.groups:
            token_slots[rows] = slot
        return _slot_mask(token_slots, slots, width, dtype)


def _slot_mask(token_slots: torch.Tensor, slots: int, width: int,
               dtype: torch.dtype) -> torch.Tensor:
    columns = torch.arange(slots * width, device=token_slots.device) // width
    return (token_slots[:, None] == columns[None, :]).to(dtype)


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
    alike, the adapters' A and B stay in the compute dtype) plus the adapters' deltas, in the
    pass's form (LoRABatch): the per-row kernels; one adapter's A and B over every row; each
    adapter's rows gathered, their two low-rank products, the delta added back into those rows
    (four operations an adapter, products of its own rows only); or every slot's low-rank
    products at once, each row masked to its own slot's columns before B (three operations
    whatever the mix)."""
    stacks: LoRAStacks = layer.lora
    batch = stacks.batch
    if batch.single is None and not batch.groups and batch.token_slots is None:
        return out
    x2 = x.reshape(-1, x.shape[-1])
    out2 = out.reshape(-1, out.shape[-1])
    assert out2.data_ptr() == out.data_ptr(), "the deltas must land in `out` itself"
    width = stacks.width
    if batch.single is not None:
        cols = slice(batch.single * width, (batch.single + 1) * width)
        out2.addmm_(x2 @ stacks.a[cols].t(), stacks.b[:, cols].t())
    elif batch.groups:
        for slot, rows in batch.groups:
            cols = slice(slot * width, (slot + 1) * width)
            low = x2.index_select(0, rows) @ stacks.a[cols].t()
            out2.index_add_(0, rows, low @ stacks.b[:, cols].t())
    elif batch.rows_kernel:
        add_lora_rows(x2, stacks.a, stacks.b, batch.token_slots, width, out2)
    else:
        low = x2 @ stacks.a.t()
        low.mul_(batch.mask(stacks.slots, width, low.dtype))
        out2.addmm_(low, stacks.b.t())
    return out


# ---- MLA's kv_b_proj (models/deepseek_v2.py): the model reads its weight itself ----
def add_lora_entries(layer: torch.nn.Module, latent: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """An extend pass's decompression: out [N, out] (latent entries [N, latent] times the
    weight) plus each entry's adapter delta, by `LoRABatch.entry_slots` (the entries of
    every cached prefix, then the new tokens)."""
    stacks: LoRAStacks | None = layer.lora
    if stacks is None or stacks.batch.entry_slots is None:
        return out
    low = latent @ stacks.a.t()
    low.mul_(_slot_mask(stacks.batch.entry_slots, stacks.slots, stacks.width, low.dtype))
    return out.addmm_(low, stacks.b.t())


def _head_mask(layer: torch.nn.Module, tokens: int, like: torch.Tensor
               ) -> tuple["LoRAStacks", torch.Tensor] | None:
    stacks: LoRAStacks | None = layer.lora
    if stacks is None:
        return None
    mask = stacks.batch.any_form_mask(tokens, stacks.slots, stacks.width, like.dtype,
                                      like.device)
    return None if mask is None else (stacks, mask[:, None, :])


def add_lora_absorbed_query(layer: torch.nn.Module, q_nope: torch.Tensor,
                            q_latent: torch.Tensor) -> torch.Tensor:
    """Decode with kv_b_proj absorbed into the query: q_latent [T, H, latent] = q_nope
    [T, H, nope] W_UK per head, plus (q_nope B_UK) A for each token's adapter (B's rows of
    each head's keys, [H, nope, slots x r])."""
    found = _head_mask(layer, q_nope.shape[0], q_nope)
    if found is None:
        return q_latent
    stacks, mask = found
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    b_keys = stacks.b.view(heads, -1, stacks.b.shape[1])[:, :nope]
    low = torch.einsum("thn,hnr->thr", q_nope, b_keys) * mask
    return q_latent + low @ stacks.a


def add_lora_absorbed_output(layer: torch.nn.Module, out_latent: torch.Tensor,
                             out: torch.Tensor, nope: int) -> torch.Tensor:
    """Decode's output through W_UV per head: out [T, H, v] plus (out_latent A^T) B_UV^T for
    each token's adapter."""
    found = _head_mask(layer, out_latent.shape[0], out_latent)
    if found is None:
        return out
    stacks, mask = found
    heads = out_latent.shape[1]
    b_values = stacks.b.view(heads, -1, stacks.b.shape[1])[:, nope:]
    low = (out_latent @ stacks.a.t()) * mask
    return out + torch.einsum("thr,hvr->thv", low, b_values)
