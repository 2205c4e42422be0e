"""FusedMoE: the routed experts of one layer, weights stacked per expert.

Parameters (this rank's part; experts are sharded along their intermediate size, like a
column-parallel gate|up and a row-parallel down projection):
  w13_weight [E, 2 * I / tp, H]   gate rows then up rows of every expert
  w2_weight  [E, H, I / tp]       down projection of every expert
Checkpoints store each expert apart (`experts.{e}.gate_proj.weight` / `w1`, ...); the loader
maps a name to (parameter, (expert id, "w1" | "w3" | "w2")) with `expert_weight_target` and
the parameter's `weight_loader` places the rank's slice in the expert's row of the stack.
`expected_shards` on each parameter lists every (expert, piece) the checkpoint must provide.

forward(hidden [T, H], TopK) -> [T, H], the routed experts' outputs weighted and summed over
the k choices, not reduced over tensor-parallel ranks (the MoE block adds the shared expert
first and reduces once). GPU: Triton fused-MoE kernels (layers/kernels/fused_moe.py; biases in
their epilogues, SiLU-mul or gpt-oss's clamped SwiGLU between them); CPU, without Triton or
another activation: a loop over the experts some token chose.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.activation import gated_activation
from radixserve.layers.moe.int4_experts import (add_int4_expert_params,
                                                drop_int4_expert_params, finish_int4_experts,
                                                int4_expert_weights, int4_stacks)
from radixserve.layers.moe.router import TopK
from radixserve.layers.quantization.fp8 import (FP8_DTYPE, current_fp8_config,
                                                dequantize_weight, expand_scale,
                                                quantize_per_channel, rank_block_columns,
                                                rank_group_k, row_amax)
from radixserve.layers.quantization.int4 import current_int4_config

# checkpoint piece names -> our piece ids (gate = w1, up = w3, down = w2, as Mixtral names them)
_PIECES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
           "w1": "w1", "w3": "w3", "w2": "w2"}
# a leaf "weight" / "weight_scale" names the w13_weight / w2_weight stacks and their FP8
# scales; int4 checkpoints' leaves (AWQ / GPTQ, compressed-tensors) name int4_experts.py's
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale|qweight|qzeros"
                          r"|scales|g_idx|weight_packed|weight_zero_point|weight_shape"
                          r"|weight_g_idx|bias)$")


# shard kind of a stack stored inputs first: [E, H, 2I] / [E, I, H] (Llama-4's, always)
STACKED_INPUTS_FIRST = "all_inputs_first"


def expert_weight_target(name: str, inputs_first: bool = False
                         ) -> tuple[str, tuple[int | str, str]] | None:
    """'...mlp.experts.3.gate_proj.weight' -> ('...mlp.experts.w13_weight', (3, 'w1')); an FP8
    checkpoint's '...gate_proj.weight_scale' -> '...w13_weight_scale'; all experts in one
    tensor, as transformers saves models it has no per-expert mapping for (Mistral-4):
    '...mlp.experts.gate_up_proj' [E, 2I, H] (gate rows then up) -> (w13_weight,
    ('all', 'w13')), '...mlp.experts.down_proj' [E, H, I] -> (w2_weight, ('all', 'w2')).
    inputs_first: the family stores its stacks transposed, [E, H, 2I] / [E, I, H], whatever
    their sizes (STACKED_INPUTS_FIRST; 'all' guesses from the shapes, which square stacks
    leave open)."""
    prefix, _, leaf = name.rpartition(".")
    if prefix.endswith(".experts"):
        projection = leaf.removesuffix("_inv").removesuffix("_scale")  # FP8's scales
        if projection in ("gate_up_proj", "down_proj"):
            piece = "w13" if projection == "gate_up_proj" else "w2"
            suffix = "_scale" if projection != leaf else ""
            kind = STACKED_INPUTS_FIRST if inputs_first and not suffix else "all"
            return f"{prefix}.{piece}_weight{suffix}", (kind, piece)
    found = _EXPERT_NAME.match(name)
    if found is None or found.group(3) not in _PIECES:
        return None
    prefix, expert, piece = found.group(1), int(found.group(2)), _PIECES[found.group(3)]
    stack = "w2" if piece == "w2" else "w13"
    return f"{prefix}.{stack}_{found.group(4)}", (expert, piece)


class FusedMoE(nn.Module):
    group_k: int | None = None  # FP8 block scales: input columns per scale group (both GEMMs)
    supports_int4 = True  # subclasses whose kernels have no int4 form say False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: str = "silu", **activation_options: float) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank, group.size
        if intermediate_size % self.tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} does not split "
                             f"over {self.tp_size} ranks")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size // self.tp_size  # this rank's
        size = self.intermediate_size
        self.fp8 = current_fp8_config()
        self.int4 = current_int4_config()  # int4_experts.py: packed stacks, no w13_weight
        self._w2_row_amax: dict[int, torch.Tensor] = {}  # --quantization fp8 at tp > 1
        dtype = FP8_DTYPE if self.fp8 is not None and not self.fp8.online else None
        if self.int4 is not None:
            if not self.supports_int4:
                raise ValueError(f"int4 ({self.int4.method}) checkpoints of this model's "
                                 f"experts ({type(self).__name__}) are not supported yet")
            add_int4_expert_params(self, self.int4)
        else:
            self._add_stacks(dtype)
        if self.fp8 is not None:
            self._add_fp8_scales(size)
        self.activation = activation
        self.act = gated_activation(activation, **activation_options)

    def _add_stacks(self, dtype: torch.dtype | None) -> None:
        """w13_weight / w2_weight (in `dtype`, default the compute dtype)."""
        size, experts = self.intermediate_size, self.num_experts
        self.w13_weight = nn.Parameter(torch.empty(experts, 2 * size, self.hidden_size,
                                                   dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(experts, self.hidden_size, size, dtype=dtype),
                                      requires_grad=False)
        for param, pieces in ((self.w13_weight, ("w1", "w3")), (self.w2_weight, ("w2",))):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            param.expected_shards = {(e, p) for e in range(experts)  # type: ignore
                                     for p in pieces}
            param.keep_dtype = dtype is not None  # type: ignore[attr-defined]

    def keep_unquantized(self) -> None:
        """The checkpoint leaves these experts unquantised: plain stacks instead of int4's."""
        drop_int4_expert_params(self)
        self._add_stacks(None)

    @property
    def biases(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate|up bias [E, 2I/tp], down bias [E, H]) where the experts have them."""
        return None

    # ---- FP8 experts: scales [E, rows, K groups], loaded like the weights' rows ----
    def _add_fp8_scales(self, size: int) -> None:
        """One group width for both projections (the fused kernel takes one): the checkpoint's
        block, or, where the down projection's columns split inside blocks over the ranks,
        the finer groups of fp8.rank_group_k."""
        assert self.fp8 is not None
        self.group_k = rank_group_k(self.fp8.block, size, self.tp_size > 1)
        for name, rows, k, pieces in (("w13_weight_scale", 2 * size, self.hidden_size,
                                       ("w1", "w3")),
                                      ("w2_weight_scale", self.hidden_size, size, ("w2",))):
            groups = 1 if self.group_k is None else -(-k // self.group_k)
            param = nn.Parameter(torch.ones(self.num_experts, rows, groups), requires_grad=False)
            param.weight_loader = self.scale_loader  # type: ignore[attr-defined]
            param.expected_shards = {(e, p) for e in range(self.num_experts)  # type: ignore
                                     for p in pieces}
            param.keep_dtype = True  # type: ignore[attr-defined]
            param.optional = self.fp8.online  # type: ignore[attr-defined]
            setattr(self, name, param)

    def _load_scale_stack(self, param: nn.Parameter, loaded: torch.Tensor,
                          piece: str) -> set[tuple[int, str]]:
        """Every expert's scales from one tensor [E, ...] (per tensor, per row, or per block
        of the stacked [E, 2I, H] / [E, H, I]), gate|up's rows split into gate and up."""
        assert self.fp8 is not None
        full = self.intermediate_size * self.tp_size
        if loaded.shape[0] != self.num_experts:
            raise ValueError(f"stacked expert scales of shape {tuple(loaded.shape)} for "
                             f"{self.num_experts} experts")
        block = self.fp8.block
        if piece == "w13" and block is not None and full % block:
            raise ValueError(f"gate|up scale blocks of {block} rows straddle the gate and up "
                             f"halves ({full} rows each)")
        pieces = ("w1", "w3") if piece == "w13" else ("w2",)
        for expert in range(self.num_experts):
            scales = loaded[expert]
            if piece == "w13" and scales.dim() > 0 and scales.shape[0] > 1:
                halves = scales.split(scales.shape[0] // 2)  # rows (or row blocks) halved
            else:
                halves = (scales,) * len(pieces)  # one scale for the whole stack
            for name, half in zip(pieces, halves):
                self.scale_loader(param, half, (expert, name))
        return {(expert, name) for expert in range(self.num_experts) for name in pieces}

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: object = None) -> set[tuple[int, str]] | None:
        """A checkpoint scale of one expert piece, expanded to its rows (per tensor, per
        channel or per block), then split over the ranks as the piece's weight is."""
        assert isinstance(shard_id, tuple) and self.fp8 is not None
        if shard_id[0] == "all":
            return self._load_scale_stack(param, loaded, shard_id[1])
        expert, piece = shard_id
        size, rank = self.intermediate_size, self.tp_rank
        rows = self.hidden_size if piece == "w2" else size * self.tp_size
        block = self.fp8.block
        expanded = expand_scale(loaded, rows, block)
        if block is not None:  # the columns: this rank's groups (w2's split, w13's whole)
            k_offset, k_rank = (rank * size, size) if piece == "w2" else (0, self.hidden_size)
            expanded = rank_block_columns(expanded, block, self.group_k, k_offset, k_rank)
        if piece == "w2":
            param.data[expert].copy_(expanded)
        else:
            target = param.data[expert].narrow(0, 0 if piece == "w1" else size, size)
            target.copy_(expanded.narrow(0, rank * size, size))

    def finish_loading(self) -> None:
        """--quantization fp8: each expert's weights become FP8 codes with per-row scales; int4
        stacks are packed (or dequantised on the CPU)."""
        finish_int4_experts(self)
        if self.fp8 is None or not self.fp8.online:
            return
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(self, name)
            amax = self._w2_row_amax if name == "w2_weight" else {}
            codes, scales = zip(*(quantize_per_channel(w, amax.get(expert))
                                  for expert, w in enumerate(weight.data)))
            param = nn.Parameter(torch.stack(codes), requires_grad=False)
            param.keep_dtype = True  # type: ignore[attr-defined]
            setattr(self, name, param)
            getattr(self, f"{name}_scale").data = torch.stack(scales)
        self._w2_row_amax.clear()

    def _expert_weights(self, expert: int, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.int4 is not None:
            return int4_expert_weights(self, expert, dtype)
        if self.fp8 is None:
            return self.w13_weight[expert], self.w2_weight[expert]
        block = self.group_k
        return (dequantize_weight(self.w13_weight[expert], self.w13_weight_scale[expert], block,
                                  dtype),
                dequantize_weight(self.w2_weight[expert], self.w2_weight_scale[expert], block,
                                  dtype))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> set[tuple[int, str]] | None:
        """One expert's piece; or, with shard_id ('all', 'w13' | 'w2'), every expert's stacked
        in one tensor (returns the (expert, piece) shards it loaded, for the loader's check)."""
        if not isinstance(shard_id, tuple):
            raise ValueError("expert weights load per expert: shard_id is (expert, piece)")
        if shard_id[0] in ("all", STACKED_INPUTS_FIRST):
            return self._load_stack(param, loaded, shard_id[1],
                                    inputs_first=shard_id[0] == STACKED_INPUTS_FIRST)
        expert, piece = shard_id
        size, rank = self.intermediate_size, self.tp_rank
        if piece == "w2":
            want = (self.hidden_size, size * self.tp_size)
            part = loaded.narrow(1, rank * size, size) if loaded.shape == want else None
            target = param.data[expert]
        else:
            want = (size * self.tp_size, self.hidden_size)
            part = loaded.narrow(0, rank * size, size) if loaded.shape == want else None
            target = param.data[expert].narrow(0, 0 if piece == "w1" else size, size)
        if part is None:
            raise ValueError(f"expert {expert} {piece} of shape {tuple(loaded.shape)}, "
                             f"expected {want}")
        if piece == "w2" and self.fp8 is not None and self.fp8.online and self.tp_size > 1:
            # --quantization fp8 scales the down projection's whole rows, as at tp 1
            self._w2_row_amax[expert] = row_amax(loaded)
        target.copy_(part)

    def _load_stack(self, param: nn.Parameter, loaded: torch.Tensor, piece: str,
                    inputs_first: bool = False) -> set[tuple[int, str]]:
        """Every expert's gate|up [E, 2I, H] or down [E, H, I] from one tensor; or the same
        transposed, [E, H, 2I] / [E, I, H], as Qwen3-VL-MoE's hub checkpoints store them
        (transformers transposes a stack whose shape is not its own, as here) and Llama-4's
        always do (`inputs_first`)."""
        full = self.intermediate_size * self.tp_size
        want = (self.num_experts, 2 * full, self.hidden_size) if piece == "w13" else \
            (self.num_experts, self.hidden_size, full)
        if inputs_first or (tuple(loaded.shape) != want and
                            tuple(loaded.transpose(1, 2).shape) == want):
            loaded = loaded.transpose(1, 2)
        if tuple(loaded.shape) != want:
            raise ValueError(f"stacked experts {piece} of shape {tuple(loaded.shape)}, "
                             f"expected {want}")
        return self.load_experts(param, piece, lambda expert: loaded[expert])

    def load_experts(self, param: nn.Parameter, piece: str,
                     matrix_of: Callable[[int], torch.Tensor]) -> set[tuple[int, str]]:
        """Each expert's whole matrix, `matrix_of(expert)`: gate|up [2I, H] (gate rows, then
        up rows) or down [H, I], loaded piece by piece through `weight_loader` (this rank's
        part); the (expert, piece) shards loaded."""
        full = self.intermediate_size * self.tp_size
        pieces = ("w1", "w3") if piece == "w13" else ("w2",)
        for expert in range(self.num_experts):
            matrix = matrix_of(expert)
            halves = matrix.split(full) if piece == "w13" else (matrix,)
            for name, half in zip(pieces, halves):
                self.weight_loader(param, half, (expert, name))
        return {(expert, name) for expert in range(self.num_experts) for name in pieces}

    def fused_options(self) -> dict[str, object] | None:
        """fused_experts' arguments past the weights and choices, where the fused kernels
        serve this layer's activation; None otherwise."""
        swiglu = (self.act.alpha, self.act.limit) if self.activation == "swigluoai" else None
        if self.activation != "silu" and swiglu is None:
            return None
        scales = (self.w13_weight_scale, self.w2_weight_scale, self.group_k) \
            if self.fp8 is not None else None
        int4 = int4_stacks(self) if self.int4 is not None else None
        return {"fp8_scales": scales, "biases": self.biases, "swiglu": swiglu, "int4": int4}

    def forward(self, hidden: torch.Tensor, topk: TopK) -> torch.Tensor:
        options = self.fused_options() if hidden.is_cuda else None
        if options is not None:
            try:
                from radixserve.layers.kernels.fused_moe import fused_experts
            except ImportError:
                pass
            else:
                w13, w2 = (self.w13_int4_qweight, self.w2_int4_qweight) \
                    if self.int4 is not None else (self.w13_weight, self.w2_weight)
                return fused_experts(hidden, w13, w2, topk.weights, topk.ids,
                                     **options)  # type: ignore[arg-type]
        return self.forward_native(hidden, topk)

    def forward_native(self, hidden: torch.Tensor, topk: TopK) -> torch.Tensor:
        """Loop over the experts at least one token chose (one host sync for the list)."""
        out = torch.zeros_like(hidden)
        flat_ids = topk.ids.reshape(-1)
        flat_weights = topk.weights.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // topk.ids.shape[1]
            x = hidden.index_select(0, tokens)
            w13, w2 = self._expert_weights(expert, hidden.dtype)
            if self.biases is None:
                y = self.act(x @ w13.t()) @ w2.t()
            else:
                b13, b2 = self.biases
                y = self.act(x @ w13.t() + b13[expert].to(x.dtype)) @ w2.t() + \
                    b2[expert].to(x.dtype)
            # weights stay float32 in the product, as transformers multiplies them
            y = y * flat_weights.index_select(0, pairs).unsqueeze(1)
            out.index_add_(0, tokens, y.to(out.dtype))
        return out
