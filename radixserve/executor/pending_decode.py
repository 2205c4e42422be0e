"""A decode step that was launched but whose sampled ids have not been read back yet.

The overlap path of the scheduler launches decode step k+1 before it reads step k's ids: step
k+1 takes its input ids from `ids` (a device tensor) and the host copy of `ids` is read only
after the launch, so the GPU never waits for Python between two steps.
"""
from __future__ import annotations

import torch


class PendingDecode:
    """Sampled ids of one launched decode step: `ids` on the device, read with `token_ids()`."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids  # [bs] int64 on the model's device; next steps read it as input
        self._event: torch.cuda.Event | None = None
        if ids.is_cuda:
            # one asynchronous copy into pinned memory; the event says when it has landed
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = ids
        self._token_ids: list[int] | None = None

    def token_ids(self) -> list[int]:
        """The sampled ids as Python ints (waits for the step to finish on the device)."""
        if self._token_ids is None:
            if self._event is not None:
                self._event.synchronize()
            self._token_ids = self._host.tolist()
        return self._token_ids
