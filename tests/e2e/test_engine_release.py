"""Engine.shutdown() releases the model, the KV pools and the attention backend right away (not
when the last reference to the Engine goes), so `bench offline --radix both` can build its
second Engine: checked by weak references on CPU, and by allocated bytes on a GPU."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import radixserve
from tests.models.tiny_checkpoints import make_checkpoint


def test_shutdown_drops_model_and_pools(tmp_path) -> None:
    make_checkpoint("llama_gqa_llama3_rope", tmp_path)
    engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=1024)
    engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    runner = engine.scheduler.runner
    refs = [weakref.ref(runner.model), weakref.ref(runner.token_to_kv_pool),
            weakref.ref(runner.attn_backend)]
    del runner
    engine.shutdown()
    gc.collect()
    assert all(ref() is None for ref in refs)  # the Engine object itself is still alive


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shutdown_returns_gpu_memory(tmp_path) -> None:
    make_checkpoint("llama_gqa_llama3_rope", tmp_path)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = radixserve.Engine(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True,
                               max_total_tokens=200_000)
    engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
    assert torch.cuda.memory_allocated() - before > 50 * 2**20  # the KV pool at least
    engine.shutdown()
    assert torch.cuda.memory_allocated() - before < 8 * 2**20
