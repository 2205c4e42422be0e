"""GatedDeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5.

x -> in_proj_qkvz -> (q | k | v through a causal depthwise conv + SiLU, z) and in_proj_ba -> (b,
a); beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule
(layers/gated_delta_rule.py) over q, k, v; RMSNorm of each value head gated by SiLU(z); out_proj.

Per request it keeps the conv's last inputs and the rule's state in a RecurrentStatePool row (the
request's ReqToTokenPool row, mem/recurrent_state_pool.py), which the ModelRunner attaches after
building the pools (`attach_recurrent_states`). A pass from position 0 starts from zero states.

Tensor parallelism splits key heads and value heads over the ranks (each key head with the value
heads it serves), so the conv's channels, A_log and dt_bias split alike and out_proj is row
parallel. Checkpoint layouts:
  * Qwen3.5: in_proj_qkv (q | k | v), in_proj_z, in_proj_b, in_proj_a, each whole;
  * Qwen3-Next: in_proj_qkvz and in_proj_ba grouped per key head ([q k v z] of head 0, then of
    head 1, ...; [b a] likewise), regrouped here at load.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.layers.gated_delta_rule import chunked, conv_step, prepare_qk, recurrent_step
from radixserve.layers.linear import (RowParallelLinear, _rank_and_size, _shard,
                                      default_weight_loader)
from radixserve.layers.merged_linear import MergedColumnParallelLinear
from radixserve.layers.recurrent_mixer import (TRITON_ON, PiecewiseConv, RankPieces,
                                              RecurrentMixer, extend_kernels)
from radixserve.mem.recurrent_state_pool import RecurrentStateSpec


class GroupedInProjection(MergedColumnParallelLinear):
    """A merged projection whose pieces also arrive as one tensor: grouped per key head
    (Qwen3-Next: shard None; each piece's rows of every key head in turn) or as several whole
    pieces stacked (`stacked` shard ids, Qwen3.5's in_proj_qkv: pieces 0-2). FP8 scales load
    through the same method, expanded to one row per weight row first."""

    def __init__(self, input_size: int, output_sizes: list[int], num_groups: int,
                 stacked: dict[object, tuple[int, ...]] | None = None) -> None:
        self.num_groups = num_groups
        self.stacked = stacked or {}
        super().__init__(input_size, output_sizes)

    def full_rows(self, shard_id: object = None) -> int:
        if shard_id is None:
            return sum(self.output_sizes)
        if shard_id in self.stacked:
            return sum(self.output_sizes[i] for i in self.stacked[shard_id])
        return super().full_rows(shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        if shard_id in self.stacked:
            pieces = self.stacked[shard_id]
            sizes = [self.output_sizes[i] for i in pieces]
            for piece, part in zip(pieces, loaded.split(sizes, dim=0)):
                super().weight_loader(param, part, piece)
            return
        if shard_id is not None:
            super().weight_loader(param, loaded, shard_id)
            return
        if loaded.shape[0] != sum(self.output_sizes):
            raise ValueError(f"grouped projection of {loaded.shape[0]} rows, expected "
                             f"{sum(self.output_sizes)}")
        per_group = [size // self.num_groups for size in self.output_sizes]
        grouped = loaded.reshape(self.num_groups, sum(per_group), *loaded.shape[1:])
        for piece, part in enumerate(grouped.split(per_group, dim=1)):
            super().weight_loader(param, part.reshape(-1, *loaded.shape[1:]), piece)


def _head_param(heads: int, fill: float) -> nn.Parameter:
    """A per-value-head parameter (A_log, dt_bias), split over the ranks."""
    rank, size = _rank_and_size(None, None)
    param = nn.Parameter(torch.full((heads // size,), fill), requires_grad=False)
    param.weight_loader = lambda p, loaded: default_weight_loader(  # type: ignore[attr-defined]
        p, _shard(loaded, 0, rank, size))
    return param


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head (weight * normed, rounded to the input dtype), times
    SiLU(gate) in float32: Qwen3-Next's and Qwen3.5's RMSNormGated."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(RecurrentMixer):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, key_dim: int,
                 value_dim: int, conv_kernel: int, eps: float, state_index: int,
                 grouped_checkpoint: bool, beta_scale: float = 1.0) -> None:
        """state_index: this layer's index among the model's linear-attention layers (its
        RecurrentStatePool layer). grouped_checkpoint: Qwen3-Next's per-key-head layout.
        beta_scale: beta = beta_scale * sigmoid(b) (OLMo-Hybrid's 2: negative eigenvalues)."""
        super().__init__()
        rank, tp_size = _rank_and_size(None, None)
        if num_k_heads % tp_size or num_v_heads % num_k_heads:
            raise ValueError(f"{num_k_heads} key heads and {num_v_heads} value heads do not "
                             f"split over {tp_size} ranks")
        self.num_k_heads, self.num_v_heads = num_k_heads // tp_size, num_v_heads // tp_size
        self.key_dim, self.value_dim = key_dim, value_dim
        self.group = num_v_heads // num_k_heads
        keys, values = num_k_heads * key_dim, num_v_heads * value_dim
        self.conv_channels = (2 * keys + values) // tp_size
        stacked = None if grouped_checkpoint else {"qkv": (0, 1, 2)}
        self.in_proj_qkvz = GroupedInProjection(hidden_size, [keys, keys, values, values],
                                                num_k_heads, stacked)
        self.in_proj_ba = GroupedInProjection(hidden_size, [num_v_heads, num_v_heads],
                                              num_k_heads)
        self.conv1d = PiecewiseConv(RankPieces.split_evenly([keys, keys, values], rank,
                                                            tp_size), conv_kernel, bias=False)
        self.conv_width = conv_kernel - 1
        self.dt_bias = _head_param(num_v_heads, 1.0)
        self.A_log = _head_param(num_v_heads, 0.0)
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = RowParallelLinear(values, hidden_size)
        self.state_index = state_index
        self.beta_scale = beta_scale

    def state_spec(self, num_layers: int, dtype: torch.dtype) -> RecurrentStateSpec:
        return RecurrentStateSpec(num_layers, self.conv_channels, self.conv_width,
                                  self.num_v_heads, self.key_dim, self.value_dim, dtype)

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight

    def forward(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        values = self.num_v_heads * self.value_dim
        mixed, z = self.in_proj_qkvz(hidden).split([self.conv_channels, values], dim=-1)
        b, a = self.in_proj_ba(hidden).split([self.num_v_heads] * 2, dim=-1)
        conv_states, ssm_states = self.layer_states()
        if forward_batch.forward_mode.is_decode():
            out = self._decode(mixed, (a, b), forward_batch.req_pool_indices, conv_states,
                               ssm_states)
        else:
            out = torch.empty(tokens, self.num_v_heads, self.value_dim, dtype=torch.float32,
                              device=hidden.device)
            self._extend(mixed, (a, b), self._gates(a, b), forward_batch, conv_states,
                         ssm_states, out)
        if out.is_cuda and TRITON_ON:
            from radixserve.layers.kernels.gated_rmsnorm import gated_rmsnorm
            normed = gated_rmsnorm(out, z, self.norm.weight, self.norm.variance_epsilon,
                                   hidden.dtype)
        else:
            normed = self.norm(out.to(hidden.dtype).reshape(-1, self.value_dim),
                               z.reshape(-1, self.value_dim)).reshape(tokens, values)
        return self.out_proj(normed)

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Conv output [..., channels] -> prepared q, k [..., value heads, key_dim] and v."""
        keys = self.num_k_heads * self.key_dim
        q, k, v = mixed.split([keys, keys, self.num_v_heads * self.value_dim], dim=-1)
        q, k = prepare_qk(q.unflatten(-1, (self.num_k_heads, self.key_dim)),
                          k.unflatten(-1, (self.num_k_heads, self.key_dim)), self.group)
        return q, k, v.unflatten(-1, (self.num_v_heads, self.value_dim))

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta): the log decay -exp(A_log) * softplus(a + dt_bias) in float32, and
        sigmoid(b)."""
        beta = b.sigmoid() if self.beta_scale == 1.0 else b.sigmoid() * self.beta_scale
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), beta

    def _decode(self, mixed: torch.Tensor, step_inputs: tuple[torch.Tensor, ...],
                rows: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor
                ) -> torch.Tensor:
        """One token per request (step_inputs: a, b), each continuing its row's states
        (CUDA-graph safe). On the GPU two Triton launches (kernels/gdn_decode.py) unless
        RADIXSERVE_GDN_TRITON=0."""
        a, b = step_inputs
        if mixed.is_cuda and TRITON_ON:
            from radixserve.layers.kernels.gdn_decode import gdn_decode
            return gdn_decode(mixed, a, b, self.A_log, self.dt_bias, self.conv1d.weight,
                              conv_states, ssm_states, rows, self.num_k_heads, self.key_dim,
                              self.value_dim, self.beta_scale)
        g, beta = self._gates(a, b)
        mixed, conv_states[rows] = conv_step(mixed, self.conv1d.weight, conv_states[rows])
        q, k, v = self._split_heads(mixed)
        out, ssm_states[rows] = recurrent_step(q, k, v, g, beta, ssm_states[rows])
        return out

    def _scan_padded(self, conv_out: torch.Tensor, scan_inputs: tuple[torch.Tensor, ...],
                     start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunked gated delta rule over q, k, v of the conv output (scan_inputs: g, beta),
        in two Triton launches on the GPU for models other than float32 (whose IEEE products
        there lost to the torch loop, PERFORMANCE session 44)."""
        q, k, v = self._split_heads(conv_out)
        args = (q, k, v, *scan_inputs, start)
        if conv_out.is_cuda and extend_kernels.usable and conv_out.dtype != torch.float32:
            from radixserve.layers.kernels.gdn_chunk import chunked_triton
            ran = extend_kernels.run(chunked_triton, *args)
            if ran is not None:
                return ran
        return chunked(*args)
