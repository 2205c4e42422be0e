"""`get_tokenizer`: the tokenizer of a resolved model, local files only.

HF folders load with `AutoTokenizer.from_pretrained`. GGUF files build a fast tokenizer from
their metadata (gguf_tokenizer.py) once and keep it, saved with `save_pretrained`, in the user
cache (cache_dir.py); later loads read that folder (~0.1 s instead of ~0.45 s).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from radixserve.loader.cache_dir import write_folder_atomically
from radixserve.loader.model_resolution import (TOKENIZER_FILES, ResolvedModel,
                                                no_tokenizer_files, resolve_model_path)

logger = logging.getLogger(__name__)
# a processor's chat template (multimodal repos), read where the tokenizer has none
PROCESSOR_CHAT_TEMPLATE = "chat_template.json"


def load_gguf_tokenizer(gguf_path: str, use_cache: bool = True) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF file describes; built once, then read from the user cache."""
    from radixserve.loader.gguf_file import read_gguf
    from radixserve.loader.gguf_loader import gguf_cache_folder
    from radixserve.loader.gguf_tokenizer import build_gguf_tokenizer
    folder = gguf_cache_folder(gguf_path) / "tokenizer"
    if use_cache and folder.is_dir():
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as exc:  # damaged entry: rebuild it below
            logger.warning("ignoring unreadable cached tokenizer %s: %s", folder, exc)
    tokenizer = build_gguf_tokenizer(read_gguf(gguf_path))
    if use_cache:
        write_folder_atomically(folder, lambda tmp: _save(tokenizer, tmp))
    return tokenizer


def _save(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    tokenizer.save_pretrained(str(folder))


def get_tokenizer(source: str | ResolvedModel) -> PreTrainedTokenizerBase:
    """The tokenizer for `source`: a ResolvedModel, or anything `resolve_model_path` accepts
    (the default model name, an HF folder, a .gguf file)."""
    resolved = source if isinstance(source, ResolvedModel) else resolve_model_path(source)
    if resolved.kind == "gguf":
        tokenizer = load_gguf_tokenizer(resolved.path)
    elif not resolved.has_tokenizer_files:
        raise no_tokenizer_files(resolved.path)
    else:
        tokenizer = _with_processor_template(
            AutoTokenizer.from_pretrained(resolved.path, local_files_only=True), resolved.path)
    return _unbounded(tokenizer)


def _with_processor_template(tokenizer: PreTrainedTokenizerBase,
                             folder: str) -> PreTrainedTokenizerBase:
    """A multimodal repo may keep its chat template only in the processor's
    chat_template.json, which the tokenizer does not read: the tokenizer takes it from
    there when it has none of its own (as vLLM resolves it)."""
    path = Path(folder) / PROCESSOR_CHAT_TEMPLATE
    if getattr(tokenizer, "chat_template", None) or not path.is_file():
        return tokenizer
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return tokenizer
    if isinstance(template, str) and template:
        tokenizer.chat_template = template
    return tokenizer


def _unbounded(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    # lengths are checked against the model's context by request validation, with a message
    # for the user; transformers' own length warning would only add noise to the log
    tokenizer.model_max_length = 1 << 62
    return tokenizer


def load_tokenizer_path(path: str, flag: str = "--tokenizer-path") -> PreTrainedTokenizerBase:
    """--tokenizer-path's tokenizer: a folder of tokenizer files (no model needed, as vLLM's
    --tokenizer takes), a .gguf file or a model `resolve_model_path` finds, or a hub repo of a
    tokenizer alone (through transformers' hub cache, downloaded unless offline). `flag`: the
    option its errors name (the benchmarks' --tokenizer takes the same)."""
    folder = Path(path).expanduser()
    if folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES):
        return _unbounded(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    try:
        return get_tokenizer(path)
    except (OSError, ValueError) as model_error:
        if folder.exists():
            raise ValueError(f"{flag} {path}: {model_error}") from None
        try:  # a hub id of a tokenizer-only repo
            return _unbounded(AutoTokenizer.from_pretrained(path))
        except (OSError, ValueError):
            raise ValueError(f"{flag} {path!r} is neither a folder of tokenizer "
                             f"files nor a model or tokenizer repo found: {model_error}") from None


def model_tokenizer(tokenizer_path: str | None, model_path: str | None, required: bool,
                    model: ResolvedModel | None = None) -> PreTrainedTokenizerBase | None:
    """The tokenizer a server or an Engine uses: --tokenizer-path's where given, else the
    model's (`model`, or `model_path` resolved); a model without tokenizer files has none:
    None, or (`required`: a server taking text) a ValueError saying what to pass."""
    if tokenizer_path:
        return load_tokenizer_path(tokenizer_path)
    resolved = model or resolve_model_path(model_path)
    if not resolved.has_tokenizer_files and not required:
        return None
    return get_tokenizer(resolved)  # it says what to pass where the model has no tokenizer
