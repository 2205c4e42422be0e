"""Mamba2Mixer: the Mamba-2 token mixer of Nemotron-H, Granite-4.0-H, Bamba and Falcon-H1.

x -> in_proj -> (z, x | B | C, dt); x | B | C through a causal depthwise conv (with a bias) +
SiLU; dt = softplus(dt + dt_bias), clamped to `time_step_limit`; the SSD recurrence (layers/
ssd_rule.py) with A = -exp(A_log), k = B, q = C, v = dt * x, plus D * x; then the gated RMSNorm
(norm(y * SiLU(z)) over groups of intermediate / n_groups channels; Falcon-H1: the gate after
the norm, or no norm) and out_proj. On the GPU the extend's scan, the decode step and the norm
run as Triton kernels (kernels/ssd_chunk.py, ssd_decode.py, gated_rmsnorm.py).

B and C come in `n_groups` groups, each shared by num_heads / n_groups consecutive heads (as a
KV head by its query heads). Tensor parallelism splits the heads (z, x, dt, A_log, D, dt_bias,
the norm's weight) over the ranks; each rank holds the groups its heads read: n_groups / tp of
them, or, where there are fewer groups than ranks (one group in Granite-4.0-H and Bamba), the
one group its heads belong to, replicated. The norm's groups then span ranks: their sums of
squares are added over the ranks. out_proj is row parallel.

Per request: the conv's last inputs and a [heads, state_size, head_dim] state in the
RecurrentStatePool row (layers/recurrent_mixer.py runs the extend's segments and padding).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.distributed.parallel_state import get_tp_group
from radixserve.layers.gated_delta_net import _head_param
from radixserve.layers.gated_delta_rule import conv_step
from radixserve.layers.linear import LinearBase, RowParallelLinear, _rank_and_size
from radixserve.layers.recurrent_mixer import (TRITON_ON, KernelGuard, PiecewiseConv,
                                              RankPieces, RecurrentMixer, extend_kernels)
from radixserve.layers.ssd_rule import ssd_chunked, ssd_step
from radixserve.mem.recurrent_state_pool import RecurrentStateSpec


class PiecewiseColumnLinear(LinearBase):
    """A column-parallel projection whose pieces each split by their own rank range."""

    def __init__(self, input_size: int, pieces: RankPieces, bias: bool = False) -> None:
        self.rank_pieces = pieces
        super().__init__(input_size, pieces.rows, bias)

    def full_rows(self, shard_id: object = None) -> int:
        pieces = self.rank_pieces.pieces
        return sum(p[0] for p in pieces) if shard_id is None else pieces[int(shard_id)][0]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        self.rank_pieces.load(param.data, loaded, shard_id)


# the gated norm's kernel (kernels/gated_rmsnorm.py): a launch that fails falls back to torch
_norm_kernel = KernelGuard()


class GroupedGatedRMSNorm(nn.Module):
    """Mamba-2's gated norm: h = y * SiLU(z) in float32, RMS-normed over groups of
    `group_size` channels, weight * h rounded to the input dtype. A group that spans ranks
    (fewer groups than ranks) adds its sums of squares over them. `norm_before_gate` (Falcon-H1's
    default): weight * norm(y) * SiLU(z), all in float32, rounded at the end."""

    def __init__(self, width: int, group_size: int, eps: float,
                 norm_before_gate: bool = False) -> None:
        super().__init__()
        self.norm_before_gate = norm_before_gate
        rank, size = _rank_and_size(None, None)
        self.width, self.group_size, self.eps = width, group_size, eps
        self.total_groups = width * size // group_size
        self.first_group = rank * width // group_size
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.weight.weight_loader = (  # type: ignore[attr-defined]
            lambda p, loaded: p.data.copy_(loaded.narrow(0, rank * width, width)))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if y.is_cuda and _norm_kernel.usable and self.width % self.group_size == 0:
            from radixserve.layers.kernels.gated_rmsnorm import group_gated_rmsnorm
            out = _norm_kernel.run(group_gated_rmsnorm, y, z, self.weight, self.eps,
                                   self.group_size, self.norm_before_gate)
            if out is not None:
                return out
        h = y.float() if self.norm_before_gate else y.float() * F.silu(z.float())
        if self.width % self.group_size == 0:  # whole groups on this rank
            grouped = h.unflatten(-1, (-1, self.group_size))
            variance = grouped.pow(2).mean(-1, keepdim=True)
            h = (grouped * torch.rsqrt(variance + self.eps)).flatten(-2)
        else:  # part of one group: the ranks' sums of squares by group
            squares = h.new_zeros(h.shape[0], self.total_groups)
            squares[:, self.first_group] = h.pow(2).sum(-1)
            squares = get_tp_group().all_reduce(squares)[:, self.first_group, None]
            h = h * torch.rsqrt(squares / self.group_size + self.eps)
        if self.norm_before_gate:
            return (self.weight.float() * h * F.silu(z.float())).to(y.dtype)
        return self.weight * h.to(y.dtype)


class SiluGate(nn.Module):
    """y * SiLU(z) with no norm (Falcon-H1 without `mamba_rms_norm`)."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return y * F.silu(z)


class Mamba2Mixer(RecurrentMixer):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int,
                 n_groups: int, conv_kernel: int, eps: float, state_index: int,
                 use_conv_bias: bool = True, proj_bias: bool = False,
                 time_step_limit: tuple[float, float] = (0.0, float("inf")),
                 norm: str = "gate_then_norm", out_bias: bool | None = None) -> None:
        """state_index: this layer's index among the model's recurrent layers. norm:
        "gate_then_norm" (Mamba-2's), "norm_then_gate" or "gate" (no norm: Falcon-H1's
        choices). out_bias: out_proj's bias where it differs from in_proj's (Falcon-H1)."""
        super().__init__()
        rank, tp = _rank_and_size(None, None)
        if num_heads % tp or num_heads % n_groups or (n_groups % tp and tp % n_groups):
            raise ValueError(f"{num_heads} heads in {n_groups} groups do not split over {tp} "
                             "ranks")
        self.num_heads, self.head_dim, self.state_size = num_heads // tp, head_dim, state_size
        self.groups = max(1, n_groups // tp)  # this rank's groups
        self.heads_per_group = self.num_heads // self.groups
        inner = num_heads * head_dim
        first_group = rank * n_groups // tp
        by_heads = (inner, rank * inner // tp, inner // tp)
        by_groups = (n_groups * state_size, first_group * state_size, self.groups * state_size)
        dt = (num_heads, rank * self.num_heads, self.num_heads)
        self.inner = inner // tp
        self.conv_channels = self.inner + 2 * self.groups * state_size
        self.in_proj = PiecewiseColumnLinear(
            hidden_size, RankPieces([by_heads, by_heads, by_groups, by_groups, dt]), proj_bias)
        self.conv1d = PiecewiseConv(RankPieces([by_heads, by_groups, by_groups]), conv_kernel,
                                    use_conv_bias)
        self.conv_width = conv_kernel - 1
        self.dt_bias = _head_param(num_heads, 1.0)
        self.A_log = _head_param(num_heads, 0.0)
        self.D = _head_param(num_heads, 1.0)
        self.norm: nn.Module = SiluGate() if norm == "gate" else GroupedGatedRMSNorm(
            self.inner, inner // n_groups, eps, norm_before_gate=norm == "norm_then_gate")
        self.out_proj = RowParallelLinear(inner, hidden_size,
                                          bias=proj_bias if out_bias is None else out_bias)
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.state_index = state_index

    def state_spec(self, num_layers: int, dtype: torch.dtype) -> RecurrentStateSpec:
        return RecurrentStateSpec(num_layers, self.conv_channels, self.conv_width,
                                  self.num_heads, self.state_size, self.head_dim, dtype)

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight

    @property
    def conv_bias(self) -> torch.Tensor | None:
        return self.conv1d.bias

    def forward(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        z, mixed, dt = self.in_proj(hidden).split(
            [self.inner, self.conv_channels, self.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        low, high = self.time_step_limit
        if low > 0.0 or high != float("inf"):
            dt = dt.clamp(low, high)
        conv_states, ssm_states = self.layer_states()
        if forward_batch.forward_mode.is_decode():
            out = self._decode(mixed, (dt,), forward_batch.req_pool_indices, conv_states,
                               ssm_states)
        else:
            out = torch.empty(tokens, self.num_heads, self.head_dim, dtype=torch.float32,
                              device=hidden.device)
            self._extend(mixed, (dt,), (dt,), forward_batch, conv_states, ssm_states, out)
        y = out.reshape(tokens, self.inner).to(hidden.dtype)
        return self.out_proj(self.norm(y, z))

    def _qkv(self, conv_out: torch.Tensor, dt: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [..., channels] -> q = C, k = B [..., heads, N] (each group repeated
        for its heads), v = dt * x [..., heads, P] float32, and x."""
        n = self.groups * self.state_size
        x, b, c = conv_out.split([self.inner, n, n], dim=-1)
        x = x.unflatten(-1, (self.num_heads, self.head_dim)).float()

        def by_head(t: torch.Tensor) -> torch.Tensor:
            t = t.unflatten(-1, (self.groups, self.state_size))
            return t.repeat_interleave(self.heads_per_group, dim=-2) \
                if self.heads_per_group > 1 else t

        return by_head(c), by_head(b), x * dt[..., None], x

    def _decode(self, mixed: torch.Tensor, step_inputs: tuple[torch.Tensor, ...],
                rows: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor
                ) -> torch.Tensor:
        """One token per request (step_inputs: dt), each continuing its row's states. On the
        GPU two Triton launches (kernels/ssd_decode.py) unless RADIXSERVE_GDN_TRITON=0."""
        (dt,) = step_inputs
        if mixed.is_cuda and TRITON_ON:
            from radixserve.layers.kernels.ssd_decode import ssd_decode
            return ssd_decode(mixed, dt, self.A_log, self.D, self.conv_weight, self.conv_bias,
                              conv_states, ssm_states, rows, self.groups, self.state_size,
                              self.head_dim)
        conv_out, conv_states[rows] = conv_step(mixed, self.conv_weight, conv_states[rows],
                                                self.conv_bias)
        q, k, v, x = self._qkv(conv_out, dt)
        y, ssm_states[rows] = ssd_step(q, k, v, dt * self._a(), ssm_states[rows])
        return y + self.D.float()[:, None] * x

    def _scan_padded(self, conv_out: torch.Tensor, scan_inputs: tuple[torch.Tensor, ...],
                     start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunked SSD rule with D's term: one Triton launch on the GPU for models other
        than float32 (kernels/ssd_chunk.py, TF32 products), else the torch form."""
        (dt,) = scan_inputs
        if conv_out.is_cuda and extend_kernels.usable and conv_out.dtype != torch.float32:
            from radixserve.layers.kernels.ssd_chunk import ssd_chunked_triton
            ran = extend_kernels.run(ssd_chunked_triton, conv_out, dt, self.A_log, self.D,
                                     start, self.num_heads, self.head_dim, self.groups,
                                     self.state_size)
            if ran is not None:
                return ran
        q, k, v, x = self._qkv(conv_out, dt)
        y, final = ssd_chunked(q, k, v, dt * self._a(), start)
        return y + self.D.float()[:, None] * x, final

    def _a(self) -> torch.Tensor:
        return -self.A_log.float().exp()

