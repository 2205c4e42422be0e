"""Loading the tokenizer for the server processes, and small decoding helpers."""
from __future__ import annotations

from typing import Any

from radixserve.config import ServerArgs


def load_tokenizer(server_args: ServerArgs) -> Any | None:
    """The tokenizer the server uses, or None with --skip-tokenizer-init (input_ids only)."""
    if server_args.skip_tokenizer_init:
        return None
    from radixserve.loader.tokenizer import get_tokenizer

    return get_tokenizer(server_args.tokenizer_path or server_args.model_path)


def token_texts(tokenizer: Any | None, token_ids: list[int]) -> list[str | None]:
    """Each token decoded on its own (what OpenAI reports as `token`); None without tokenizer.
    A token that holds only part of a UTF-8 character decodes to U+FFFD."""
    if tokenizer is None:
        return [None] * len(token_ids)
    return [tokenizer.decode([tid], skip_special_tokens=False) for tid in token_ids]
