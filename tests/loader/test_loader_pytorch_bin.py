"""HF folders whose weights are pytorch_model*.bin (one file, or shards named by
pytorch_model.bin.index.json) load as their safetensors twin does, through the same loader and
per-parameter weight loaders: equal parameters and logits, for every model family. Safetensors
win where both are there; a stale shard the index does not name is not read; a file the safe
unpickler refuses is one CheckpointError naming it."""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from radixserve.config import ServerArgs
from radixserve.executor.model_runner import ModelRunner
from radixserve.loader.checkpoint_error import CheckpointError
from radixserve.loader.model_identity import model_digest
from radixserve.loader.model_source import load_model_source
from tests.models.runner_driver import RunnerDriver
from tests.models.tiny_checkpoints import make_checkpoint

from loader_test_utils import assert_a_lost_shard_is_named, make_tiny_llama, write_bin_twin

# (tiny checkpoint, .bin shard size: None for one pytorch_model.bin)
CASES = [
    ("llama_tied_mha", None),  # the tied lm_head alias stored, as transformers 4 did
    ("llama_gqa_llama3_rope", "60KB"),
    ("qwen3_qk_norm", "60KB"),
    ("gemma2_softcap_window", None),
    ("mixtral_moe", "60KB"),
    ("qwen2_moe_shared", "60KB"),
    ("deepseek_v2_lite_mla", "60KB"),
]


def _runner(folder: Path) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu",
                                  max_total_tokens=512, max_running_requests=4))


def _logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill logits of two prompts, then one decode step's."""
    gen = torch.Generator().manual_seed(1)
    vocab = runner.model_config.vocab_size
    prompts = {0: torch.randint(0, vocab, (13,), generator=gen).tolist(),
               1: torch.randint(0, vocab, (40,), generator=gen).tolist()}
    driver = RunnerDriver(runner)
    return [driver.extend(prompts), driver.extend({0: [5], 1: [7]})]


@pytest.mark.parametrize("name,shard_size", CASES, ids=[name for name, _ in CASES])
def test_bin_checkpoint_loads_as_its_safetensors_twin(name: str, shard_size: str | None,
                                                      tmp_path: Path) -> None:
    make_checkpoint(name, tmp_path / "st")
    twin = write_bin_twin(tmp_path / "st", tmp_path / "bin", shard_size)
    bins = sorted(p.name for p in twin.glob("*.bin"))
    assert not list(twin.glob("*.safetensors"))
    if shard_size is None:
        assert bins == ["pytorch_model.bin"]
    else:
        assert len(bins) > 2 and (twin / "pytorch_model.bin.index.json").is_file()
    source = load_model_source(str(twin))
    assert source.format == "pt"
    pickle.loads(pickle.dumps(source))  # travels to scheduler processes
    ours, reference = _runner(twin), _runner(tmp_path / "st")
    assert ours.source.format == "pt" and reference.source.format == "safetensors"
    want = dict(reference.model.named_parameters())
    got = dict(ours.model.named_parameters())
    assert got.keys() == want.keys()
    for param_name, param in want.items():
        assert torch.equal(got[param_name], param), param_name
    for got_logits, want_logits in zip(_logits(ours), _logits(reference)):
        assert torch.equal(got_logits, want_logits)


@pytest.fixture(scope="module")
def sharded_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("st")
    make_tiny_llama().save_pretrained(folder)
    return write_bin_twin(folder, folder.parent / "sharded-bin", "60KB")


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    source = load_model_source(str(folder))
    return {name: tensor.clone() for name, tensor in source.weights()}


def test_safetensors_win_over_bin_files_beside_them(sharded_bin: Path, tmp_path: Path) -> None:
    """As vLLM: a folder with both formats is read from its safetensors; its .bin files serve
    once the safetensors are gone."""
    folder = tmp_path / "both"
    shutil.copytree(sharded_bin, folder)
    other = make_tiny_llama(seed=1)
    other.save_pretrained(tmp_path / "other")
    for path in (tmp_path / "other").glob("*.safetensors"):
        shutil.copy(path, folder)
    source = load_model_source(str(folder))
    assert source.format == "safetensors"
    got = _weights(folder)
    assert torch.equal(got["model.norm.weight"], other.state_dict()["model.norm.weight"])
    for path in folder.glob("*.safetensors"):
        path.unlink()
    source = load_model_source(str(folder))
    assert source.format == "pt"
    assert torch.equal(_weights(folder)["model.norm.weight"],
                       make_tiny_llama().state_dict()["model.norm.weight"])
    model_digest(source)  # the multi-node check samples the .bin files


def test_a_stale_bin_shard_the_index_does_not_name_is_not_read(sharded_bin: Path,
                                                               tmp_path: Path) -> None:
    want = _weights(sharded_bin)
    folder = tmp_path / "ckpt"
    shutil.copytree(sharded_bin, folder)
    stale = {name: torch.randn_like(t) for name, t in list(want.items())[:3]}
    torch.save(stale, folder / "pytorch_model-00009-of-00009.bin")
    got = _weights(folder)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_a_bin_shard_the_index_names_but_the_folder_lacks_is_named(sharded_bin: Path,
                                                                   tmp_path: Path) -> None:
    assert_a_lost_shard_is_named(sharded_bin, "pytorch_model-*.bin", tmp_path)


class _RunsCode:
    """Unpickling it would run a shell command: the safe unpickler must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _corrupt(kind: str, path: Path, marker: Path) -> None:
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[:300])
    elif kind == "runs-code":
        torch.save({"model.norm.weight": torch.ones(64), "x": _RunsCode(marker)}, path)
    elif kind == "not-a-state-dict":
        torch.save([torch.ones(2)], path)
    else:  # garbage
        path.write_bytes(b"not a checkpoint" * 64)


@pytest.mark.parametrize("kind", ["truncated", "runs-code", "not-a-state-dict", "garbage"])
def test_an_unreadable_bin_is_one_checkpoint_error_naming_it(kind: str, sharded_bin: Path,
                                                             tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(sharded_bin, folder)
    bad = sorted(folder.glob("pytorch_model-*.bin"))[1]
    marker = tmp_path / "code-ran"
    _corrupt(kind, bad, marker)
    source = load_model_source(str(folder))
    with pytest.raises(CheckpointError) as info:
        list(source.weights())
    message = str(info.value)
    assert str(bad) in message and "\n" not in message
    assert info.value.show_traceback is False
    assert not marker.exists()
    if kind == "runs-code":
        assert "weights_only" in message and "system" in message


def test_a_bin_in_torch_legacy_format_loads(sharded_bin: Path, tmp_path: Path) -> None:
    """Files written before torch 1.6's zip format cannot be memory-mapped: read whole."""
    want = _weights(sharded_bin)
    folder = tmp_path / "legacy"
    folder.mkdir()
    shutil.copy(sharded_bin / "config.json", folder)
    torch.save(want, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    got = _weights(folder)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_load_format_safetensors_refuses_bin_weights(sharded_bin: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--load-format auto"):
        load_model_source(str(sharded_bin), "safetensors")
