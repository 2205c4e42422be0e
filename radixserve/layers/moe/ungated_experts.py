"""UngatedExperts: routed experts without a gate, down(act(up(x))), act ReLU squared
(Nemotron-H's MoE layers, Nemotron-3-Nano).

FusedMoE's layout with w13_weight holding the up projection only: [E, I / tp, H]; the checkpoint
names each expert's `experts.{e}.up_proj.weight` (piece "w3") and `down_proj.weight`. GPU: the
fused-MoE kernels with the activation between them (`fused_experts(activation="relu2")`, a few
decode tokens through the MoE GEMVs' ungated form); elsewhere
FusedMoE's loop over the chosen experts. FP8: `--quantization fp8` quantises them at load, as
FusedMoE's (per-row scales, whose rows finish_loading sets); FP8 checkpoints are refused.
"""
from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.activation import relu_squared
from radixserve.layers.moe.experts import FusedMoE


class _Ungated(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_squared(x)


class UngatedExperts(FusedMoE):
    supports_int4 = False  # no int4 form of its kernels (int4_support.py)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: str) -> None:
        if activation != "relu2":
            raise ValueError(f"ungated experts' activation {activation!r} is not supported "
                             "(only relu2)")
        super().__init__(num_experts, hidden_size, intermediate_size)
        if self.fp8 is not None and not self.fp8.online:
            raise ValueError("FP8 checkpoints of ungated (ReLU-squared) experts are not "
                             "supported (--quantization fp8 of a bf16 one is)")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, self.intermediate_size,
                                                   hidden_size), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.w13_weight.expected_shards = {(e, "w3")  # type: ignore[attr-defined]
                                           for e in range(num_experts)}
        self.activation = activation
        self.act = _Ungated()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> set[tuple[int, str]] | None:
        """An expert's up projection (piece "w3", the whole of w13) or down projection."""
        if isinstance(shard_id, tuple) and shard_id[1] == "w1":
            raise ValueError("ungated experts have no gate projection")
        if not (isinstance(shard_id, tuple) and shard_id[1] == "w3"):
            return super().weight_loader(param, loaded, shard_id)
        expert = shard_id[0]
        size, rank = self.intermediate_size, self.tp_rank
        want = (size * self.tp_size, self.hidden_size)
        if tuple(loaded.shape) != want:
            raise ValueError(f"expert {expert} up projection of shape "
                             f"{tuple(loaded.shape)}, expected {want}")
        param.data[expert].copy_(loaded.narrow(0, rank * size, size))
        return None

    def fused_options(self) -> dict[str, object] | None:
        scales = (self.w13_weight_scale, self.w2_weight_scale, self.group_k) \
            if self.fp8 is not None else None
        return {"fp8_scales": scales, "activation": "relu2"}
