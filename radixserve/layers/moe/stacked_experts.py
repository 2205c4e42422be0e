"""StackedExperts: FusedMoE for checkpoints that store all experts of a layer in one tensor
per projection (gpt-oss), with biases.

gpt-oss's tensors (`...mlp.experts.` + name):
  gate_up_proj       [E, H, 2I]   gate and up interleaved along the last dim (gate even)
  gate_up_proj_bias  [E, 2I]      interleaved the same way
  down_proj          [E, I, H]
  down_proj_bias     [E, H]
or, MXFP4-quantised (`quant_method: mxfp4`), the projections as `{name}_blocks`
[E, rows, K / 32, 16] and `{name}_scales` [E, rows, K / 32], rows being the output features
(2I interleaved, or H) and K the input ones. They are dequantised as soon as both halves have
arrived (layers/quantization/mxfp4.py), one expert at a time, and loaded as the bf16 tensors
are: as our [E, out, in], gate|up split into gate rows then up rows, this rank's part of I
kept.

The down projection's bias is added on rank 0 only: every rank's output is a partial sum that
the MoE block reduces once.
"""
from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.moe.experts import FusedMoE
from radixserve.layers.quantization.mxfp4 import dequantize_mxfp4

_PROJECTIONS = {"gate_up_proj": "w13", "down_proj": "w2"}


def stacked_expert_target(name: str) -> tuple[str, tuple[str, str]] | None:
    """'...mlp.experts.gate_up_proj' -> ('...mlp.experts.w13_weight', ('w13', 'weight')), its
    '_bias' -> w13_bias, its MXFP4 '_blocks' / '_scales' -> w13_weight with those parts."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".experts"):
        return None
    for projection, piece in _PROJECTIONS.items():
        if leaf == projection:
            return f"{prefix}.{piece}_weight", (piece, "weight")
        if leaf == f"{projection}_bias":
            return f"{prefix}.{piece}_bias", (piece, "bias")
        for part in ("blocks", "scales"):
            if leaf == f"{projection}_{part}":
                return f"{prefix}.{piece}_weight", (piece, part)
    return None


class StackedExperts(FusedMoE):
    supports_int4 = False  # no int4 form of its kernels (int4_support.py)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: str, mxfp4: bool = False, **activation_options: float) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, activation,
                         **activation_options)
        if self.fp8 is not None and not self.fp8.online:
            raise ValueError("stacked experts from an FP8 checkpoint are not supported")
        parts = {"blocks", "scales"} if mxfp4 else {"weight"}
        size = self.intermediate_size
        self.w13_bias = nn.Parameter(torch.zeros(num_experts, 2 * size), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False)
        for param, piece, wanted in ((self.w13_weight, "w13", parts), (self.w2_weight, "w2", parts),
                                     (self.w13_bias, "w13", {"bias"}),
                                     (self.w2_bias, "w2", {"bias"})):
            param.weight_loader = self.stacked_loader  # type: ignore[attr-defined]
            param.expected_shards = {(piece, part) for part in wanted}  # type: ignore
        self._pending: dict[tuple[str, str], torch.Tensor] = {}  # an MXFP4 half, waiting

    @property
    def biases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 bias [E, 2I/tp], w2 bias [E, H], zero on ranks past 0)."""
        return self.w13_bias, self.w2_bias

    def stacked_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                       shard_id: object = None) -> None:
        if not isinstance(shard_id, tuple):
            raise ValueError("stacked expert tensors load with a (projection, part) shard id")
        piece, part = shard_id
        full = self.intermediate_size * self.tp_size
        # [out, in] of the checkpoint: gate|up's 2I interleaved rows by H, down's H by I
        out_in = (2 * full, self.hidden_size) if piece == "w13" else (self.hidden_size, full)
        if part in ("blocks", "scales"):
            other = "scales" if part == "blocks" else "blocks"
            if (piece, other) not in self._pending:
                self._pending[(piece, part)] = loaded
                return
            halves = {part: loaded, other: self._pending.pop((piece, other))}
            blocks, scales = halves["blocks"], halves["scales"]
            want = (self.num_experts, out_in[0], out_in[1] // 32, 16)
            if tuple(blocks.shape) != want or tuple(scales.shape) != want[:3]:
                raise ValueError(f"{piece} MXFP4 blocks {tuple(blocks.shape)} / scales "
                                 f"{tuple(scales.shape)}, expected {want} / {want[:3]}")
            # one expert at a time: the whole stack's float32 temporaries would take tens of GB
            self.load_experts(param, piece, lambda e: _gate_then_up(dequantize_mxfp4(
                blocks[e], scales[e], param.dtype), piece))
            return
        want = {("w13", "weight"): (self.num_experts, out_in[1], out_in[0]),
                ("w2", "weight"): (self.num_experts, out_in[1], out_in[0]),
                ("w13", "bias"): (self.num_experts, 2 * full),
                ("w2", "bias"): (self.num_experts, self.hidden_size)}[(piece, part)]
        if tuple(loaded.shape) != want:
            raise ValueError(f"{piece} {part} of shape {tuple(loaded.shape)}, expected {want}")
        if part == "weight":  # [E, in, out]
            self.load_experts(param, piece, lambda e: _gate_then_up(loaded[e].t(), piece))
        elif piece == "w2":
            param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
        else:  # this rank's gate and up biases, interleaved in the checkpoint
            size, rank = self.intermediate_size, self.tp_rank
            gate_up = _gate_then_up(loaded.t(), piece).t()  # [E, 2 * full]
            for half in (0, 1):
                param.data.narrow(1, half * size, size).copy_(
                    gate_up.narrow(1, half * full + rank * size, size))

    def finish_loading(self) -> None:
        if self._pending:
            missing = sorted(f"{piece} {'scales' if part == 'blocks' else 'blocks'}"
                             for piece, part in self._pending)
            raise ValueError(f"MXFP4 experts without their other half: {missing}")
        super().finish_loading()


def _gate_then_up(matrix: torch.Tensor, piece: str) -> torch.Tensor:
    """An [out, ...] gate|up matrix with gate and up rows interleaved (gate even) as gate rows
    then up rows; other pieces as they are."""
    return torch.cat((matrix[0::2], matrix[1::2])) if piece == "w13" else matrix
