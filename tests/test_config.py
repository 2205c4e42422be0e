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


def _hf(arch: str, **extra: object) -> dict:
    return dict(architectures=[arch], vocab_size=100, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, **extra)


@pytest.mark.parametrize("arch, extra, context", [
    ("MistralForCausalLM", dict(sliding_window=256), 256),       # Mistral v0.1: capped
    ("MistralForCausalLM", dict(sliding_window=None), 1024),     # later Mistrals: no window
    ("MistralForCausalLM", dict(sliding_window=4096), 1024),     # window past the context
    ("Qwen2ForCausalLM", dict(sliding_window=256, use_sliding_window=False), 1024),
    ("Qwen2ForCausalLM", dict(sliding_window=256, use_sliding_window=True), 256),
    ("LlamaForCausalLM", {}, 1024),
])
def test_sliding_window_caps_the_context(arch: str, extra: dict, context: int) -> None:
    """Sliding-window attention is not implemented; within the window full attention is the
    same, so the context stops at the window instead of giving wrong outputs past it."""
    from radixserve.config import ModelConfig
    cfg = ModelConfig.from_hf_dict(_hf(arch, **extra))
    cfg.resolve_context_length(None)
    assert cfg.context_length == context
    cfg.resolve_context_length(100)
    assert cfg.context_length == 100
