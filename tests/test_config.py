"""ServerArgs.resolve(): device defaults, and flags that cannot run are refused, not ignored."""
from __future__ import annotations

import pytest

from radixserve.config import ServerArgs


def test_cpu_defaults() -> None:
    args = ServerArgs(device="cpu").resolve()
    assert args.attention_backend == "cpu" and args.disable_cuda_graph  # torch_native + kernels
    assert args.chunked_prefill_size == 512 and args.cuda_graph_max_bs == 256
    assert not args.disable_overlap_schedule


@pytest.mark.parametrize("bad, message", [
    (dict(tp_size=0), "tp-size must be >= 1"),
    (dict(tp_size=2, nnodes=2), "dist-init-addr"),
    (dict(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1"), "spread evenly"),
    (dict(nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1"), "not a node"),
    (dict(dp_size=2, load_balance_method="random"), "load-balance-method"),
    (dict(schedule_policy="newest"), "schedule-policy"),
    (dict(admission_plan="eager"), "admission-plan"),
])
def test_unsupported_flags_are_refused(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs(device="cpu", **bad).resolve()


def _hf(arch: str, **extra: object) -> dict:
    return dict(architectures=[arch], vocab_size=100, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, **extra)


@pytest.mark.parametrize("arch, extra, windows", [
    ("MistralForCausalLM", dict(sliding_window=256), [256, 256]),       # Mistral v0.1
    ("MistralForCausalLM", dict(sliding_window=None), [None, None]),    # later Mistrals
    ("MistralForCausalLM", dict(sliding_window=4096), [None, None]),    # window past the context
    ("Qwen2ForCausalLM", dict(sliding_window=256, use_sliding_window=False), [None, None]),
    ("Qwen2ForCausalLM", dict(sliding_window=256, use_sliding_window=True, max_window_layers=1),
     [None, 256]),                                                       # layers past the first
    ("Gemma2ForCausalLM", dict(sliding_window=256, head_dim=16), [256, None]),  # alternating
    ("LlamaForCausalLM", {}, [None, None]),
])
def test_sliding_window_per_layer_keeps_the_full_context(arch: str, extra: dict,
                                                         windows: list) -> None:
    """Sliding-window attention is implemented: the context is the model's, each layer gets
    the window transformers gives it."""
    from radixserve.core.model_config import ModelConfig
    cfg = ModelConfig.from_hf_dict(_hf(arch, **extra))
    cfg.resolve_context_length(None)
    assert cfg.context_length == 1024
    assert [cfg.layer_sliding_window(i) for i in range(2)] == windows
    cfg.resolve_context_length(100)
    assert cfg.context_length == 100


def test_a_bad_grammar_cache_size_fails_when_the_arguments_resolve(monkeypatch) -> None:
    from radixserve.config import ServerArgs
    monkeypatch.setenv("RADIXSERVE_GRAMMAR_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="RADIXSERVE_GRAMMAR_CACHE_MB must be a number"):
        ServerArgs(device="cpu").resolve()
    monkeypatch.setenv("RADIXSERVE_GRAMMAR_CACHE_MB", "64")
    ServerArgs(device="cpu").resolve()


def test_revision_joins_a_hub_model_id(tmp_path) -> None:
    """--revision is model_path@revision, which every loader resolves (vLLM's and SGLang's
    flag); refused for a local path, the bundled model, or a path naming one already."""
    from radixserve.config import ServerArgs
    args = ServerArgs(model_path="myorg/tiny", revision="v1", device="cpu").resolve()
    assert args.model_path == "myorg/tiny@v1" and args.revision is None
    for path in (str(tmp_path), "SmolLM2-135M-Instruct", "myorg/tiny@main"):
        with pytest.raises(ValueError, match="revision"):
            ServerArgs(model_path=path, revision="v1", device="cpu").resolve()


def test_a_config_without_architectures_takes_its_model_types() -> None:
    """As transformers picks the causal LM by model_type: a Qwen2 config.json lacking
    `architectures` is Qwen2 (it was taken for Llama and failed on q/k/v biases)."""
    from radixserve.core.model_config import ModelConfig, hf_config_from_dict
    config = _hf("Qwen2ForCausalLM", model_type="qwen2")
    del config["architectures"]
    assert ModelConfig(hf_config_from_dict(config)).architecture == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="model_type 'phi' is none of ours"):
        hf_config_from_dict({**config, "model_type": "phi"})


def test_a_context_past_the_models_positions_is_refused_unless_allowed(monkeypatch) -> None:
    """As vLLM and SGLang: a --context-length above max_position_embeddings is an error, or
    with RADIXSERVE_ALLOW_LONGER_CONTEXT=1 taken as given (it was cut to the model's)."""
    from radixserve.core.model_config import ModelConfig
    cfg = ModelConfig.from_hf_dict(_hf("LlamaForCausalLM"))
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        cfg.resolve_context_length(4096)
    monkeypatch.setenv("RADIXSERVE_ALLOW_LONGER_CONTEXT", "1")
    cfg.resolve_context_length(4096)
    assert cfg.context_length == 4096


def test_a_ten_million_position_model_serves_a_million_by_default() -> None:
    """Llama-4 Scout's 10,485,760 positions: the default context and the rope tables stop at
    DEFAULT_CONTEXT_CAP; a longer context is served when asked for."""
    from radixserve.core.model_config import DEFAULT_CONTEXT_CAP, ModelConfig
    cfg = ModelConfig.from_hf_dict({**_hf("LlamaForCausalLM"),
                                    "max_position_embeddings": 10485760})
    cfg.resolve_context_length(None)
    assert cfg.context_length == cfg.rope_positions == DEFAULT_CONTEXT_CAP == 1 << 20
    cfg.resolve_context_length(2_000_000)
    assert cfg.context_length == cfg.rope_positions == 2_000_000
    small = ModelConfig.from_hf_dict(_hf("LlamaForCausalLM"))
    small.resolve_context_length(None)
    assert small.context_length == small.rope_positions == small.max_position_embeddings


@pytest.mark.parametrize("rope, ok", [
    (None, True),
    ({"rope_type": "linear", "factor": 2.0}, True),
    ({"rope_type": "dynamic", "factor": 2.0}, True),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, True),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 256}, True),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
      "original_max_position_embeddings": 256}, True),
    ({"rope_type": "proportional", "factor": 2.0}, False),
])
def test_rope_scaling_kinds_are_supported_or_refused(rope: dict | None, ok: bool) -> None:
    from radixserve.core.model_config import ModelConfig
    extra = {} if rope is None else {"rope_scaling": rope}
    if ok:
        ModelConfig.from_hf_dict(_hf("LlamaForCausalLM", **extra))
    else:
        with pytest.raises(ValueError, match="not supported"):
            ModelConfig.from_hf_dict(_hf("LlamaForCausalLM", **extra))


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_computes_in_float32_where_the_cpu_lacks_bf16(monkeypatch: pytest.MonkeyPatch,
                                                                 native: bool) -> None:
    import torch

    from radixserve import config
    monkeypatch.setattr(config, "cpu_computes_natively", lambda dtype: native)
    auto_cpu = config.resolve_dtype("auto", "bfloat16", "cpu")
    assert auto_cpu == (torch.bfloat16 if native else torch.float32)
    # an explicit dtype, another device and a float32 checkpoint are taken as they are
    assert config.resolve_dtype("bfloat16", "bfloat16", "cpu") == torch.bfloat16
    assert config.resolve_dtype("auto", "bfloat16", "cuda") == torch.bfloat16
    assert config.resolve_dtype("auto", "float32", "cpu") == torch.float32


def test_json_encoded_floats_are_read_as_transformers_reads_them() -> None:
    """transformers writes floats JSON cannot hold as {"__float__": ...} (Nemotron-H's
    time_step_limit of [0, inf]); other such dicts stay as they are."""
    from radixserve.core.model_config import _json_floats
    read = _json_floats({"a": [0.0, {"__float__": "Infinity"}], "b": {"__float__": "-Infinity"},
                         "c": {"__float__": "foo"}, "d": {"x": {"__float__": "NaN"}}})
    assert read["a"] == [0.0, float("inf")] and read["b"] == float("-inf")
    assert read["c"] == {"__float__": "foo"} and read["d"]["x"] != read["d"]["x"]  # NaN


def test_legacy_layer_type_names_read_as_transformers_5s() -> None:
    """Granite-4.0-H's released configs say "mamba" / "attention" (transformers 5.25 renames
    them itself; a config object that kept them, as earlier releases do, is read the same)."""
    from types import SimpleNamespace

    from radixserve.core.model_config import ModelConfig
    hf = SimpleNamespace(architectures=["GraniteMoeHybridForCausalLM"], vocab_size=100,
                         hidden_size=64, num_attention_heads=4, num_hidden_layers=3,
                         layer_types=["mamba", "attention", "mamba"])
    hf.get_text_config = lambda decoder=True: hf
    assert ModelConfig(hf).layer_types == ["linear_attention", "full_attention",
                                           "linear_attention"]


def test_lora_flags_take_vllms_and_sglangs_names_and_defaults() -> None:
    """--lora-modules (vLLM) and --max-loras-per-batch (SGLang) are our --lora-paths and
    --max-loras; --enable-lora alone makes vLLM's one slot of rank 16."""
    import argparse
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--lora-modules", "a=/x", "b=/y", "--max-loras-per-batch", "3", "--device", "cpu"]))
    assert args.lora_paths == ["a=/x", "b=/y"] and args.max_loras == 3
    alone = ServerArgs.from_cli_args(parser.parse_args(["--enable-lora", "--device", "cpu"]))
    alone.resolve()
    assert (alone.max_loras, alone.max_lora_rank, alone.lora_enabled()) == (1, 16, True)
