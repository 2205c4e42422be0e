"""ServerArgs.resolve(): device defaults, and flags that cannot run are refused, not ignored."""
from __future__ import annotations

import pytest

from radixserve.config import ServerArgs


def test_cpu_defaults() -> None:
    args = ServerArgs(device="cpu").resolve()
    assert args.attention_backend == "torch_native" and args.disable_cuda_graph
    assert args.chunked_prefill_size == 512 and args.cuda_graph_max_bs == 256
    assert not args.disable_overlap_schedule


@pytest.mark.parametrize("bad, message", [
    (dict(tp_size=2), "tensor parallelism"),
    (dict(schedule_policy="newest"), "schedule-policy"),
])
def test_unsupported_flags_are_refused(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs(device="cpu", **bad).resolve()
