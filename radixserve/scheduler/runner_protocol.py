"""What the scheduler needs of a model runner: executor.model_runner.ModelRunner, or the fakes
the scheduler tests drive it with."""
from __future__ import annotations

from typing import Any, Protocol

from radixserve.core.forward_batch import ModelWorkerBatch


class ModelRunnerLike(Protocol):
    """What the scheduler needs of a model runner (the real one, or a fake in tests)."""
    req_to_token_pool: Any
    token_to_kv_pool: Any
    max_total_num_tokens: int
    max_num_reqs: int
    vocab_size: int
    device: Any

    def forward(self, batch: ModelWorkerBatch) -> Any: ...

    def forward_decode_async(self, batch: ModelWorkerBatch,
                             input_ids: Any = None) -> Any: ...

    def forward_extend_async(self, batch: ModelWorkerBatch) -> Any: ...
