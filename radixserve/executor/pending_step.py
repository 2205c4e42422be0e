"""A decode step that was launched but whose sampled ids have not been read back yet.

The overlap path of the scheduler launches decode step k+1 before it reads step k's ids: step
k+1 takes its input ids from `ids` (a device tensor) and the host copies of `ids` (and of the
step's logprobs, when asked) are read only after the launch, so the GPU never waits for Python
between two steps.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.core.forward_batch import ForwardOutput
from radixserve.executor.sampler import DeviceLogprobs, top_logprob_lists


class PendingStep:
    """Sampled ids (and logprobs) of one launched decode step, read with `token_ids()` or
    `output()`; `ids` stays on the model's device for the next step to read as input."""

    def __init__(self, ids: torch.Tensor, logprobs: DeviceLogprobs | None = None) -> None:
        self.ids = ids  # [bs] int64
        device_tensors = [ids]
        if logprobs is not None:
            device_tensors += [t for t in logprobs if t is not None]
        self._event: torch.cuda.Event | None = None
        if ids.is_cuda:
            # asynchronous copies into pinned memory; the event says when they have landed
            self._host = []
            for tensor in device_tensors:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                self._host.append(host)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = device_tensors
        self._has_logprobs = logprobs is not None
        self._token_ids: list[int] | None = None

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def token_ids(self) -> list[int]:
        """The sampled ids as Python ints (waits for the step to finish on the device)."""
        if self._token_ids is None:
            self._wait()
            self._token_ids = self._host[0].tolist()
        return self._token_ids

    def output(self, top_k_nums: Sequence[int]) -> ForwardOutput:
        """The step's ForwardOutput (waits for the step): ids, and when the step computed them,
        each id's logprob and each row's top_k_nums[row] best (logprob, id)."""
        token_ids = self.token_ids()
        if not self._has_logprobs:
            return ForwardOutput(token_ids)
        top_values = self._host[2].tolist() if len(self._host) > 2 else None
        top_ids = self._host[3].tolist() if len(self._host) > 2 else None
        return ForwardOutput(token_ids, self._host[1].tolist(),
                             top_logprob_lists(top_values, top_ids, top_k_nums))
