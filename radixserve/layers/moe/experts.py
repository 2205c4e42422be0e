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
first and reduces once). GPU: Triton fused-MoE kernels (layers/kernels/fused_moe.py); CPU or
without Triton: a loop over the experts some token chose.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.activation import gated_activation
from radixserve.layers.moe.router import TopK

# checkpoint piece names -> our piece ids (gate = w1, up = w3, down = w2, as Mixtral names them)
_PIECES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
           "w1": "w1", "w3": "w3", "w2": "w2"}
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def expert_weight_target(name: str) -> tuple[str, tuple[int, str]] | None:
    """'...mlp.experts.3.gate_proj.weight' -> ('...mlp.experts.w13_weight', (3, 'w1'))."""
    found = _EXPERT_NAME.match(name)
    if found is None or found.group(3) not in _PIECES:
        return None
    prefix, expert, piece = found.group(1), int(found.group(2)), _PIECES[found.group(3)]
    param = "w2_weight" if piece == "w2" else "w13_weight"
    return f"{prefix}.{param}", (expert, piece)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: str = "silu") -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank, group.size
        if intermediate_size % self.tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} does not split "
                             f"over {self.tp_size} ranks")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size // self.tp_size  # this rank's
        size = self.intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, size),
                                      requires_grad=False)
        for param, pieces in ((self.w13_weight, ("w1", "w3")), (self.w2_weight, ("w2",))):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            param.expected_shards = {(e, p) for e in range(num_experts)  # type: ignore
                                     for p in pieces}
        self.activation = activation
        self.act = gated_activation(activation)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        if not isinstance(shard_id, tuple):
            raise ValueError("expert weights load per expert: shard_id is (expert, piece)")
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
        target.copy_(part)

    def forward(self, hidden: torch.Tensor, topk: TopK) -> torch.Tensor:
        if hidden.is_cuda and self.activation == "silu":
            try:
                from radixserve.layers.kernels.fused_moe import fused_experts
            except ImportError:
                pass
            else:
                return fused_experts(hidden, self.w13_weight, self.w2_weight, topk.weights,
                                     topk.ids)
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
            y = self.act(x @ self.w13_weight[expert].t()) @ self.w2_weight[expert].t()
            # weights stay float32 in the product, as transformers multiplies them
            y = y * flat_weights.index_select(0, pairs).unsqueeze(1)
            out.index_add_(0, tokens, y.to(out.dtype))
        return out
