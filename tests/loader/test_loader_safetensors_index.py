"""Which files of an HF folder hold the weights: those its safetensors index names (stale shards
from another save and Mistral's consolidated.safetensors are not read), and a shard the index
names but the folder lacks is one error naming it; generation_config.json's EOS ids stop
requests as config.json's do."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from radixserve.loader.checkpoint_error import CheckpointError
from radixserve.loader.model_source import load_model_source
from radixserve.loader.safetensors_loader import iter_safetensors_weights
from radixserve.loader.weight_files import SAFETENSORS, weight_files

from loader_test_utils import assert_a_lost_shard_is_named, make_tiny_llama


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    make_tiny_llama().save_pretrained(folder, max_shard_size="60KB")
    return folder


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in iter_safetensors_weights(str(folder))}


def test_the_index_names_the_weight_files(sharded: Path, tmp_path: Path) -> None:
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    want = _weights(sharded)
    folder = tmp_path / "ckpt"
    shutil.copytree(sharded, folder)
    # a leftover shard of another save (same tensor names, other values) and Mistral's
    # consolidated file (its own names) are not read
    stale = {name: torch.randn_like(t) for name, t in list(want.items())[:3]}
    save_file(stale, str(folder / "model-00009-of-00009.safetensors"))
    save_file({"layers.0.attention.wq.weight": torch.ones(2, 2)},
              str(folder / "consolidated.safetensors"))
    assert [Path(f).name for f in weight_files(str(folder), SAFETENSORS)] == shards
    got = _weights(folder)
    assert set(got) == set(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_a_shard_the_index_names_but_the_folder_lacks_is_named(sharded: Path,
                                                                tmp_path: Path) -> None:
    assert_a_lost_shard_is_named(sharded, "model-*.safetensors", tmp_path)


def test_without_an_index_consolidated_files_are_left_out(tmp_path: Path) -> None:
    make_tiny_llama().save_pretrained(tmp_path)
    save_file({"layers.0.attention.wq.weight": torch.ones(2, 2)},
              str(tmp_path / "consolidated.safetensors"))
    assert [Path(f).name for f in weight_files(str(tmp_path), SAFETENSORS)] == ["model.safetensors"]


def test_an_unreadable_weight_file_is_named(tmp_path: Path) -> None:
    make_tiny_llama().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable"):
        list(iter_safetensors_weights(str(tmp_path)))


def test_generation_config_eos_ids_join_the_stop_tokens(tmp_path: Path) -> None:
    """An instruct checkpoint listing its end-of-turn id only in generation_config.json (as
    some Llama-3 and Gemma releases do) stops there, as transformers' generate does."""
    make_tiny_llama().save_pretrained(tmp_path)  # config.json: eos 2
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 40]}))
    assert sorted(load_model_source(str(tmp_path)).model_config.eos_token_ids) == [2, 40]
