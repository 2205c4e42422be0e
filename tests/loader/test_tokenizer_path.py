"""--tokenizer-path (loader/tokenizer.py): a folder holding only tokenizer files is enough (no
model in it), the Engine uses it as the server does, and a model without tokenizer files
needs it (or --skip-tokenizer-init) where text is served."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import radixserve
from radixserve.loader.tokenizer import get_tokenizer, load_tokenizer_path, model_tokenizer

from loader_test_utils import TINY_LLAMA


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer_only")
    get_tokenizer("SmolLM2-135M-Instruct").save_pretrained(str(folder))
    assert not (folder / "config.json").exists()
    return folder


@pytest.fixture(scope="module")
def model_without_tokenizer(tmp_path_factory) -> Path:
    """A tiny Llama with the bundled tokenizer's vocabulary, saved without tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = tmp_path_factory.mktemp("no_tokenizer")
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_LLAMA, "vocab_size": 49152, "eos_token_id": 0})
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_a_folder_of_tokenizer_files_is_a_tokenizer_path(tokenizer_folder: Path) -> None:
    tokenizer = load_tokenizer_path(str(tokenizer_folder))
    bundled = get_tokenizer("SmolLM2-135M-Instruct")
    assert tokenizer.encode("Paris is big") == bundled.encode("Paris is big")


def test_a_model_without_tokenizer_files(model_without_tokenizer: Path,
                                         tokenizer_folder: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer files; pass --tokenizer-path"):
        model_tokenizer(None, str(model_without_tokenizer), required=True)
    assert model_tokenizer(None, str(model_without_tokenizer), required=False) is None
    assert model_tokenizer(str(tokenizer_folder), str(model_without_tokenizer),
                           required=True) is not None
    with pytest.raises(ValueError, match="--tokenizer-path"):
        load_tokenizer_path(str(model_without_tokenizer / "missing"))


def test_the_engine_uses_the_tokenizer_path(model_without_tokenizer: Path,
                                            tokenizer_folder: Path) -> None:
    """Text prompts work through --tokenizer-path's tokenizer (they needed input_ids)."""
    engine = radixserve.Engine(str(model_without_tokenizer), tokenizer_path=str(tokenizer_folder),
                               dtype="float32", max_total_tokens=512)
    try:
        out = engine.generate("Paris is", {"max_new_tokens": 3, "temperature": 0,
                                           "ignore_eos": True})
        assert out["meta_info"]["prompt_tokens"] == len(
            get_tokenizer("SmolLM2-135M-Instruct").encode("Paris is"))
        assert isinstance(out["text"], str) and len(out["output_ids"]) == 3
    finally:
        engine.shutdown()
