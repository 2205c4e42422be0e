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

import logging
import os
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.layers.gated_delta_rule import (CHUNK, chunked, conv_extend, conv_step,
                                                prepare_qk, recurrent_step)
from radixserve.layers.linear import (MergedColumnParallelLinear, RowParallelLinear,
                                      _rank_and_size, _shard, default_weight_loader)
from radixserve.mem.recurrent_state_pool import RecurrentStatePool, RecurrentStateSpec

# on the GPU: the decode step in two Triton launches (kernels/gdn_decode.py), the gated norm in
# one (kernels/gated_rmsnorm.py) and an extend's chunked rule in two (kernels/gdn_chunk.py,
# not for float32 models); 0: the torch paths
_TRITON = os.environ.get("RADIXSERVE_GDN_TRITON", "1") != "0"

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _KernelGuard:
    """The extend's Triton kernels (kernels/causal_conv.py, kernels/gdn_chunk.py), written and
    tested in the interpreter before any GPU compiled them: a launch that fails (a compile
    error, too little shared memory on some board) is logged once and the torch form serves
    every later extend. Each kernel writes only tensors it allocates, so a failed launch
    leaves the states untouched."""

    def __init__(self) -> None:
        self.usable = _TRITON

    def run(self, kernel: Callable[..., T], *args: object) -> T | None:
        try:
            return kernel(*args)
        except Exception as exc:  # noqa: BLE001 (any launch failure: the torch form instead)
            self.usable = False
            logger.warning("Gated DeltaNet extend kernel %s failed (%s: %s); extends run in "
                           "torch from now on", kernel.__name__, type(exc).__name__, exc)
            return None


_extend_kernels = _KernelGuard()


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


class _ConvWeight(nn.Module):
    """conv1d.weight as the checkpoint names it, [channels, 1, kernel] there, [this rank's
    channels, kernel] here: q, k and v channels each split over the ranks. It loads whole, or
    as its q, k and v pieces (shard 0, 1, 2: OLMo-Hybrid's q_conv1d / k_conv1d / v_conv1d)."""

    def __init__(self, piece_sizes: list[int], kernel: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = _rank_and_size(None, None)
        self.piece_sizes = piece_sizes
        self.weight = nn.Parameter(torch.empty(sum(piece_sizes) // self.tp_size, kernel),
                                   requires_grad=False)
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]

    def load(self, param: nn.Parameter, loaded: torch.Tensor,
             shard_id: object = None) -> set[int] | None:
        """Returns the pieces a whole tensor covered (weight_loading records them)."""
        loaded = loaded.reshape(loaded.shape[0], -1)
        if shard_id is None:
            for piece, part in enumerate(loaded.split(self.piece_sizes, dim=0)):
                self.load(param, part, piece)
            return set(range(len(self.piece_sizes)))
        piece = int(shard_id)  # type: ignore[call-overload]
        if loaded.shape[0] != self.piece_sizes[piece]:
            raise ValueError(f"conv piece {piece} of {loaded.shape[0]} channels, expected "
                             f"{self.piece_sizes[piece]}")
        offset = sum(self.piece_sizes[:piece]) // self.tp_size
        size = self.piece_sizes[piece] // self.tp_size
        default_weight_loader(param.data.narrow(0, offset, size),  # type: ignore[arg-type]
                              _shard(loaded, 0, self.tp_rank, self.tp_size))
        return None


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


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, key_dim: int,
                 value_dim: int, conv_kernel: int, eps: float, state_index: int,
                 grouped_checkpoint: bool, beta_scale: float = 1.0) -> None:
        """state_index: this layer's index among the model's linear-attention layers (its
        RecurrentStatePool layer). grouped_checkpoint: Qwen3-Next's per-key-head layout.
        beta_scale: beta = beta_scale * sigmoid(b) (OLMo-Hybrid's 2: negative eigenvalues)."""
        super().__init__()
        _, tp_size = _rank_and_size(None, None)
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
        self.conv1d = _ConvWeight([keys, keys, values], conv_kernel)
        self.conv_width = conv_kernel - 1
        self.dt_bias = _head_param(num_v_heads, 1.0)
        self.A_log = _head_param(num_v_heads, 0.0)
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = RowParallelLinear(values, hidden_size)
        self.state_index = state_index
        self.beta_scale = beta_scale
        self.states: RecurrentStatePool | None = None

    def state_spec(self, num_layers: int, dtype: torch.dtype) -> RecurrentStateSpec:
        return RecurrentStateSpec(num_layers, self.conv_channels, self.conv_width,
                                  self.num_v_heads, self.key_dim, self.value_dim, dtype)

    def forward(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        assert self.states is not None, "no RecurrentStatePool attached"
        tokens = hidden.shape[0]
        values = self.num_v_heads * self.value_dim
        mixed, z = self.in_proj_qkvz(hidden).split([self.conv_channels, values], dim=-1)
        b, a = self.in_proj_ba(hidden).split([self.num_v_heads] * 2, dim=-1)
        conv_states, ssm_states = self.states.layer(self.state_index)
        if forward_batch.forward_mode.is_decode():
            out = self._decode(mixed, a, b, forward_batch.req_pool_indices, conv_states,
                               ssm_states)
        else:
            out = self._extend(mixed, a, b, forward_batch, conv_states, ssm_states)
        if out.is_cuda and _TRITON:
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

    def _decode(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                rows: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor
                ) -> torch.Tensor:
        """One token per request, each continuing its row's states (CUDA-graph safe). On the
        GPU two Triton launches (kernels/gdn_decode.py) unless RADIXSERVE_GDN_TRITON=0."""
        if mixed.is_cuda and _TRITON:
            from radixserve.layers.kernels.gdn_decode import gdn_decode
            return gdn_decode(mixed, a, b, self.A_log, self.dt_bias, self.conv1d.weight,
                              conv_states, ssm_states, rows, self.num_k_heads, self.key_dim,
                              self.value_dim, self.beta_scale)
        g, beta = self._gates(a, b)
        mixed, conv_states[rows] = conv_step(mixed, self.conv1d.weight, conv_states[rows])
        q, k, v = self._split_heads(mixed)
        out, ssm_states[rows] = recurrent_step(q, k, v, g, beta, ssm_states[rows])
        return out

    def _extend(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                batch: ForwardBatch, conv_states: torch.Tensor, ssm_states: torch.Tensor
                ) -> torch.Tensor:
        """Each request's extend runs in segments cut where the batch asks for its states
        (`state_snapshots`: after that many of its tokens, into a snapshot row; the copy
        follows the segment). Round r runs every request's segment r: padded to a common
        multiple of CHUNK tokens in groups of similar length, or, one token on top of the
        row's states, as a decode step. A request's last segment of one such token (a MIXED
        pass's decodes; a prompt's last token after the states before it were kept) waits for
        the end, where all of them run in one decode step."""
        assert batch.extend_seq_lens_cpu is not None and batch.extend_prefix_lens_cpu is not None
        lens, prefixes = batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu
        device = mixed.device
        starts = [0]
        for length in lens[:-1]:
            starts.append(starts[-1] + length)
        cuts: list[list[tuple[int, int]]] = [[] for _ in lens]  # (tokens, snapshot row)
        for i, after, row in sorted(batch.state_snapshots or ()):
            if 0 < after < lens[i]:
                cuts[i].append((after, row))
        out = torch.empty(mixed.shape[0], self.num_v_heads, self.value_dim,
                          dtype=torch.float32, device=device)
        rows = batch.req_pool_indices
        g, beta = self._gates(a, b)
        stepped: list[tuple[int, int]] = []  # (request, token offset) run last, in one step
        for round_ in range(1 + max(len(c) for c in cuts)):
            padded, steps, copies = [], [], []
            for i, n in enumerate(lens):
                if n == 0 or round_ > len(cuts[i]):
                    continue
                last = round_ == len(cuts[i])  # the segment after the request's last cut
                begin = cuts[i][round_ - 1][0] if round_ else 0
                end = n if last else cuts[i][round_][0]
                continues = round_ > 0 or prefixes[i] > 0
                if end - begin == 1 and continues:
                    (stepped if last else steps).append((i, starts[i] + begin))
                else:
                    padded.append((i, starts[i] + begin, end - begin, continues))
                if not last:
                    copies.append((i, cuts[i][round_][1]))
            self._extend_grouped(mixed, g, beta, padded, rows, conv_states, ssm_states, out)
            self._step(mixed, a, b, steps, rows, conv_states, ssm_states, out)
            if copies:
                picked = rows[torch.tensor([i for i, _ in copies], device=device)]
                kept = torch.tensor([row for _, row in copies], device=device)
                conv_states[kept] = conv_states[picked]
                ssm_states[kept] = ssm_states[picked]
        self._step(mixed, a, b, stepped, rows, conv_states, ssm_states, out)
        return out

    def _step(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              tokens: list[tuple[int, int]], rows: torch.Tensor, conv_states: torch.Tensor,
              ssm_states: torch.Tensor, out: torch.Tensor) -> None:
        """One token each, (request, position in the pass), on top of its row's states."""
        if not tokens:
            return
        device = mixed.device
        at = torch.tensor([t for _, t in tokens], device=device)
        out[at] = self._decode(mixed[at], a[at], b[at],
                               rows[torch.tensor([i for i, _ in tokens], device=device)],
                               conv_states, ssm_states)

    def _extend_grouped(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        segments: list[tuple[int, int, int, bool]], rows: torch.Tensor,
                        conv_states: torch.Tensor, ssm_states: torch.Tensor,
                        out: torch.Tensor) -> None:
        """Segments (request, first position in the pass, tokens, continues the row's
        states) padded: those of 2^(j-1) + 1 .. 2^j chunks together, so padding at most doubles
        the work (one long segment beside many short ones would multiply it by their count)."""
        groups: dict[int, list[tuple[int, int, int, bool]]] = {}
        for segment in segments:
            groups.setdefault((-(-segment[2] // CHUNK) - 1).bit_length(), []).append(segment)
        for members in groups.values():
            self._extend_padded(mixed, g, beta, [s for _, s, _, _ in members],
                                [n for _, _, n, _ in members], [c for *_, c in members],
                                rows[torch.tensor([i for i, *_ in members],
                                                  device=mixed.device)],
                                conv_states, ssm_states, out)

    def _extend_padded(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       starts: list[int], lens: list[int], continues: list[bool],
                       rows: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                       out: torch.Tensor) -> None:
        device, count = mixed.device, len(lens)
        padded_len = -(-max(lens) // CHUNK) * CHUNK
        # token t of request r sits at r * padded_len + t of the padded batch
        source = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(device)
        target = torch.cat([torch.arange(r * padded_len, r * padded_len + n)
                            for r, n in enumerate(lens)]).to(device)
        keep = torch.tensor(continues, device=device)

        def padded(x: torch.Tensor) -> torch.Tensor:
            """This group's tokens, packed [tokens, ...] -> [requests, padded_len, ...]."""
            full = x.new_zeros(count * padded_len, *x.shape[1:])
            full[target] = x
            return full.unflatten(0, (count, padded_len))

        conv_out = None
        if mixed.is_cuda and _extend_kernels.usable:  # one launch, read packed, written padded
            from radixserve.layers.kernels.causal_conv import conv_extend_padded
            starts_t = torch.tensor(starts, device=device)
            lens_t = torch.tensor(lens, device=device)
            conv_out = _extend_kernels.run(conv_extend_padded, mixed, self.conv1d.weight,
                                           conv_states, rows, starts_t, lens_t, keep,
                                           padded_len)
        if conv_out is not None:
            from radixserve.layers.kernels.causal_conv import conv_states_after
            conv_states[rows] = conv_states_after(mixed, conv_states, rows, starts_t, lens_t,
                                                  keep)
        else:
            start_conv = torch.where(keep[:, None, None], conv_states[rows], 0)
            conv_out, conv_in = conv_extend(padded(mixed[source]), self.conv1d.weight,
                                            start_conv)
            # each request's new conv state: the last conv_width inputs up to its own end
            ends = torch.tensor(lens, device=device)[:, None] + \
                torch.arange(self.conv_width, device=device)
            conv_states[rows] = conv_in.gather(
                1, ends[..., None].expand(-1, -1, conv_in.shape[-1]))
            # padded positions must carry k = v = 0; the conv output there is not zero
            conv_out = padded(conv_out.flatten(0, 1)[target])
        q, k, v = self._split_heads(conv_out)
        start_ssm = torch.where(keep[:, None, None, None], ssm_states[rows], 0)
        args = (q, k, v, padded(g[source]), padded(beta[source]), start_ssm)
        ran = None
        if mixed.is_cuda and _extend_kernels.usable and mixed.dtype != torch.float32:
            from radixserve.layers.kernels.gdn_chunk import chunked_triton
            ran = _extend_kernels.run(chunked_triton, *args)  # two launches
        result, ssm_states[rows] = ran if ran is not None else chunked(*args)
        out[source] = result.flatten(0, 1)[target]


def attach_recurrent_states(model: nn.Module, pool: RecurrentStatePool) -> None:
    """Point every GatedDeltaNet of `model` at `pool`."""
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.states = pool


def recurrent_state_spec(model: nn.Module, dtype: torch.dtype) -> RecurrentStateSpec | None:
    """The pool a hybrid model needs (None: the model has no linear-attention layer)."""
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    return layers[0].state_spec(len(layers), dtype) if layers else None
