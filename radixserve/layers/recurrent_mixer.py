"""RecurrentMixer: what the token mixers of hybrid models share (the Gated DeltaNet of Qwen3-Next,
Qwen3.5 and OLMo-Hybrid, the Mamba-2 mixer of Nemotron-H, Granite-4.0-H and Bamba).

Each keeps per request, in its RecurrentStatePool row (the request's ReqToTokenPool row, mem/
recurrent_state_pool.py), the last inputs of a causal depthwise conv and one recurrent state,
and runs an extend in two phases: the conv + SiLU over the pass's tokens, then a chunked scan of
its recurrence (the subclass's `_scan_padded`). A decode step, one token per request, is the
subclass's `_decode`. This class holds the extend's bookkeeping: segments cut where the prefix
cache keeps states (`ForwardBatch.state_snapshots`), requests of similar length padded together,
one-token segments run as decode steps, and the conv in one Triton launch on the GPU.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, TypeVar

import torch
from torch import nn

from radixserve.core.forward_batch import ForwardBatch
from radixserve.layers.gated_delta_rule import CHUNK, conv_extend
from radixserve.layers.linear import default_weight_loader
from radixserve.mem.recurrent_state_pool import RecurrentStatePool, RecurrentStateSpec

# on the GPU: the mixers' Triton kernels (decode steps, the extend's conv and scans); 0: torch
TRITON_ON = os.environ.get("RADIXSERVE_GDN_TRITON", "1") != "0"

logger = logging.getLogger(__name__)
T = TypeVar("T")


class KernelGuard:
    """The extend's Triton kernels (kernels/causal_conv.py, kernels/gdn_chunk.py), written and
    tested in the interpreter before any GPU compiled them: a launch that fails (a compile
    error, too little shared memory on some board) is logged once and the torch form serves
    every later extend. Each kernel writes only tensors it allocates, so a failed launch
    leaves the states untouched."""

    def __init__(self) -> None:
        self.usable = TRITON_ON

    def run(self, kernel: Callable[..., T], *args: object) -> T | None:
        try:
            return kernel(*args)
        except Exception as exc:  # noqa: BLE001 (any launch failure: the torch form instead)
            self.usable = False
            logger.warning("recurrent extend kernel %s failed (%s: %s); extends run in "
                           "torch from now on", kernel.__name__, type(exc).__name__, exc)
            return None


extend_kernels = KernelGuard()


class RankPieces:
    """Checkpoint rows made of pieces (z | x | B | C | dt), each cut for this rank by its own
    range: (full rows, first row, rows) per piece."""

    def __init__(self, pieces: list[tuple[int, int, int]]) -> None:
        self.pieces = pieces

    @classmethod
    def split_evenly(cls, sizes: list[int], rank: int, tp_size: int) -> "RankPieces":
        """Pieces of these full sizes, each split evenly over the ranks."""
        for size in sizes:
            if size % tp_size:
                raise ValueError(f"a piece of {size} rows does not split over {tp_size} ranks")
        return cls([(size, rank * size // tp_size, size // tp_size) for size in sizes])

    @property
    def rows(self) -> int:
        return sum(size for _, _, size in self.pieces)

    def load(self, target: torch.Tensor, loaded: torch.Tensor, piece: object = None
             ) -> set[int] | None:
        """A whole tensor (piece None: returns the pieces it covered, which weight_loading
        records) or one piece into this rank's rows of `target`."""
        if piece is None:
            full = [rows for rows, _, _ in self.pieces]
            if loaded.shape[0] != sum(full):
                raise ValueError(f"tensor of {loaded.shape[0]} rows, expected {sum(full)}")
            for index, part in enumerate(loaded.split(full, dim=0)):
                self.load(target, part, index)
            return set(range(len(self.pieces)))
        index = int(piece)  # type: ignore[call-overload]
        full, first, size = self.pieces[index]
        if loaded.shape[0] != full:
            raise ValueError(f"piece {index} of {loaded.shape[0]} rows, expected {full}")
        dest = target.narrow(0, sum(s for _, _, s in self.pieces[:index]), size)
        part = loaded.narrow(0, first, size)  # a conv's [rows, 1, kernel] as our [rows, kernel]
        default_weight_loader(dest, part.reshape(dest.shape) if part.numel() == dest.numel()
                              else part)  # type: ignore[arg-type]
        return None


class PiecewiseConv(nn.Module):
    """conv1d.weight ([channels, 1, kernel] in the checkpoint, [this rank's channels, kernel]
    here) and conv1d.bias, their channels' pieces (Mamba-2's x | B | C, the Gated DeltaNet's
    q | k | v) cut by RankPieces. Each loads whole, or piece by piece (shard 0, 1, 2:
    OLMo-Hybrid's q_conv1d / k_conv1d / v_conv1d)."""

    def __init__(self, pieces: RankPieces, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(pieces.rows, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(pieces.rows), requires_grad=False) if bias \
            else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = (  # type: ignore[attr-defined]
                    lambda p, loaded, shard_id=None: pieces.load(p.data, loaded, shard_id))


# (request, first position in the pass, tokens, continues the row's states)
Segment = tuple[int, int, int, bool]


class RecurrentMixer(nn.Module):
    """Subclasses set `conv_width`, `state_index` and a conv weight [channels, conv_width + 1]
    (`conv_weight`, optionally `conv_bias`), and implement `state_spec`, `_decode` and
    `_scan_padded`."""

    state_index: int
    conv_width: int
    states: RecurrentStatePool | None = None

    def state_spec(self, num_layers: int, dtype: torch.dtype) -> RecurrentStateSpec:
        raise NotImplementedError

    @property
    def conv_weight(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def conv_bias(self) -> torch.Tensor | None:
        return None

    def _decode(self, mixed: torch.Tensor, step_inputs: tuple[torch.Tensor, ...],
                rows: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor
                ) -> torch.Tensor:
        """One token per request (`mixed` [B, channels] before the conv, `step_inputs` the
        subclass's per-token tensors), each continuing its row's states, which it updates.
        Returns [B, heads, value_dim] float32. CUDA-graph safe."""
        raise NotImplementedError

    def _scan_padded(self, conv_out: torch.Tensor, scan_inputs: tuple[torch.Tensor, ...],
                     start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrence over padded sequences: conv_out [R, L, channels] (zero past each
        end), the subclass's per-token tensors [R, L, ...] (zero past each end), start [R,
        heads, key_dim, value_dim]. Returns (out [R, L, heads, value_dim] float32, the states
        after each sequence's last token)."""
        raise NotImplementedError

    def layer_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.states is not None, "no RecurrentStatePool attached"
        return self.states.layer(self.state_index)

    def _extend(self, mixed: torch.Tensor, step_inputs: tuple[torch.Tensor, ...],
                scan_inputs: tuple[torch.Tensor, ...], batch: ForwardBatch,
                conv_states: torch.Tensor, ssm_states: torch.Tensor, out: torch.Tensor
                ) -> None:
        """Writes `out` [tokens, heads, value_dim]. Each request's extend runs in segments cut
        where the batch asks for its states (`state_snapshots`: after that many of its tokens,
        into a snapshot row; the copy follows the segment). Round r runs every request's
        segment r: padded to a common multiple of CHUNK tokens in groups of similar length,
        or, one token on top of the row's states, as a decode step. A request's last segment
        of one such token (a MIXED pass's decodes; a prompt's last token after the states
        before it were kept) waits for the end, where all of them run in one decode step.
        `step_inputs` / `scan_inputs`: per-token tensors [tokens, ...] for `_decode` /
        `_scan_padded` (the scan's zero-padded past each end)."""
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
        rows = batch.req_pool_indices
        stepped: list[tuple[int, int]] = []  # (request, token offset) run last, in one step
        for round_ in range(1 + max(len(c) for c in cuts)):
            padded: list[Segment] = []
            steps, copies = [], []
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
            self._extend_grouped(mixed, scan_inputs, padded, rows, conv_states, ssm_states,
                                 out)
            self._step(mixed, step_inputs, steps, rows, conv_states, ssm_states, out)
            if copies:
                picked = rows[torch.tensor([i for i, _ in copies], device=device)]
                kept = torch.tensor([row for _, row in copies], device=device)
                conv_states[kept] = conv_states[picked]
                ssm_states[kept] = ssm_states[picked]
        self._step(mixed, step_inputs, stepped, rows, conv_states, ssm_states, out)

    def _step(self, mixed: torch.Tensor, step_inputs: tuple[torch.Tensor, ...],
              tokens: list[tuple[int, int]], rows: torch.Tensor, conv_states: torch.Tensor,
              ssm_states: torch.Tensor, out: torch.Tensor) -> None:
        """One token each, (request, position in the pass), on top of its row's states."""
        if not tokens:
            return
        device = mixed.device
        at = torch.tensor([t for _, t in tokens], device=device)
        out[at] = self._decode(mixed[at], tuple(x[at] for x in step_inputs),
                               rows[torch.tensor([i for i, _ in tokens], device=device)],
                               conv_states, ssm_states)

    def _extend_grouped(self, mixed: torch.Tensor, scan_inputs: tuple[torch.Tensor, ...],
                        segments: list[Segment], rows: torch.Tensor, conv_states: torch.Tensor,
                        ssm_states: torch.Tensor, out: torch.Tensor) -> None:
        """Segments padded: those of 2^(j-1) + 1 .. 2^j chunks together, so padding at most
        doubles the work (one long segment beside many short ones would multiply it by their
        count)."""
        groups: dict[int, list[Segment]] = {}
        for segment in segments:
            groups.setdefault((-(-segment[2] // CHUNK) - 1).bit_length(), []).append(segment)
        for members in groups.values():
            self._extend_padded(mixed, scan_inputs, [s for _, s, _, _ in members],
                                [n for _, _, n, _ in members], [c for *_, c in members],
                                rows[torch.tensor([i for i, *_ in members],
                                                  device=mixed.device)],
                                conv_states, ssm_states, out)

    def _extend_padded(self, mixed: torch.Tensor, scan_inputs: tuple[torch.Tensor, ...],
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

        weight, bias = self.conv_weight, self.conv_bias
        conv_out = None
        if mixed.is_cuda and extend_kernels.usable:  # one launch, read packed, written padded
            from radixserve.layers.kernels.causal_conv import conv_extend_padded
            starts_t = torch.tensor(starts, device=device)
            lens_t = torch.tensor(lens, device=device)
            conv_out = extend_kernels.run(conv_extend_padded, mixed, weight, conv_states, rows,
                                          starts_t, lens_t, keep, padded_len, bias)
        if conv_out is not None:
            from radixserve.layers.kernels.causal_conv import conv_states_after
            conv_states[rows] = conv_states_after(mixed, conv_states, rows, starts_t, lens_t,
                                                  keep)
        else:
            start_conv = torch.where(keep[:, None, None], conv_states[rows], 0)
            conv_out, conv_in = conv_extend(padded(mixed[source]), weight, start_conv, bias)
            # each request's new conv state: the last conv_width inputs up to its own end
            ends = torch.tensor(lens, device=device)[:, None] + \
                torch.arange(self.conv_width, device=device)
            conv_states[rows] = conv_in.gather(
                1, ends[..., None].expand(-1, -1, conv_in.shape[-1]))
            # padded positions must read as zeros; the conv output there is not zero
            conv_out = padded(conv_out.flatten(0, 1)[target])
        start_ssm = torch.where(keep[:, None, None, None], ssm_states[rows], 0)
        result, ssm_states[rows] = self._scan_padded(
            conv_out, tuple(padded(x[source]) for x in scan_inputs), start_ssm)
        out[source] = result.flatten(0, 1)[target]


def attach_recurrent_states(model: nn.Module, pool: RecurrentStatePool) -> None:
    """Point every recurrent mixer of `model` at `pool`."""
    for module in model.modules():
        if isinstance(module, RecurrentMixer):
            module.states = pool


def recurrent_state_spec(model: nn.Module, dtype: torch.dtype) -> RecurrentStateSpec | None:
    """The pool a hybrid model needs (None: the model has no recurrent mixer)."""
    layers = [m for m in model.modules() if isinstance(m, RecurrentMixer)]
    return layers[0].state_spec(len(layers), dtype) if layers else None
