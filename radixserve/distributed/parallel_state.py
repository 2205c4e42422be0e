"""The tensor-parallel group of this process, over torch.distributed.

One process per rank. `init_tensor_parallel` joins the group once, when the ModelRunner starts
(before the model is built: the parallel layers read their rank and size here), and
`destroy_tensor_parallel` leaves it. Until then, and for --tp-size 1, the group is the trivial
group of one rank, whose collectives do nothing.

Two process groups: `device_group` carries the model's tensors (NCCL on GPUs, gloo on CPU;
collectives are captured by CUDA graphs), `cpu_group` (gloo, no practical timeout: followers
wait on it while rank 0 is idle) carries the scheduler's control messages (the requests rank 0
received, pickled) and small host integers. The ranks meet at rank 0's address through
`rendezvous.py`, which refuses ranks started unlike rank 0. The device is passed
to `init_process_group` (`device_id`): without it the first NCCL collective can hang.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from radixserve.config import split_host_port
from radixserve.distributed import rendezvous

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    device_group: Any = None  # a torch.distributed ProcessGroup; None for size 1
    cpu_group: Any = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (rank order)."""
        if self.size == 1:
            return x
        # ranks stacked along dim 0 (what every backend accepts), then moved to the last dim
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.device_group)
        stacked = out.view(self.size, *x.shape)
        return stacked.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s x on every rank, in place; returns x."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.device_group)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's picklable object, on every rank (the control channel)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def max_floats(self, values: list[float]) -> list[float]:
        """Each position's largest value over the ranks (the control channel)."""
        if self.size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return t.tolist()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


_TRIVIAL = TensorParallelGroup()
_current = _TRIVIAL  # this process's group: set once per ModelRunner, not per batch


def get_tp_group() -> TensorParallelGroup:
    return _current


def init_tensor_parallel(rank: int, size: int, device: torch.device,
                         init_method: str | None, timeout_s: float = 600.0, nnodes: int = 1,
                         fingerprint: dict[str, Any] | None = None) -> TensorParallelGroup:
    """Join the group of `size` ranks as `rank` (size 1: the trivial group, no collectives).
    `init_method` is tcp://host:port, where rank 0 listens; the ranks meet there and rank 0
    checks they were all started alike (`fingerprint`, `rendezvous.meet`) before the group
    forms. `timeout_s` bounds that wait and every collective of the device group."""
    global _current
    if size == 1:
        _current = _TRIVIAL
        return _current
    if _current.size > 1:
        raise RuntimeError("this process is already in a tensor-parallel group")
    if init_method is None or not init_method.startswith("tcp://"):
        raise ValueError("tensor parallelism needs an init address (tcp://host:port)")
    host, port = split_host_port(init_method.removeprefix("tcp://"))
    store = rendezvous.meet(host, port, rank, size, nnodes,
                            fingerprint or {}, timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=dist.PrefixStore("radixserve/group", store),
                            world_size=size, rank=rank, timeout=timeout, **kwargs)
    device_group = dist.group.WORLD
    # the followers wait on the control channel for as long as rank 0 is idle: no timeout
    # worth the name (a dead rank takes the others down through their parent, not this)
    cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    _current = TensorParallelGroup(rank, size, device_group, cpu_group)
    logger.info("joined the tensor-parallel group: rank %d of %d (%s)", rank, size, backend)
    return _current


def destroy_tensor_parallel() -> None:
    global _current
    if _current.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _current = _TRIVIAL
