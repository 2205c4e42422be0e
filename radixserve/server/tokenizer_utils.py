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


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """The tokens decode(skip_special_tokens=True) drops, text -> id: the added tokens marked
    special (what the `tokenizers` backend skips) and the named special tokens (bos, eos, ...,
    what slow tokenizers skip)."""
    found: dict[str, int] = {}
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            found[str(token)] = int(token_id)
    for text, token_id in zip(getattr(tokenizer, "all_special_tokens", None) or [],
                              getattr(tokenizer, "all_special_ids", None) or []):
        found.setdefault(text, int(token_id))
    return found


def dropped_special_ids(tokenizer: Any, keep: tuple[str, ...] | list[str]) -> frozenset[int]:
    """The ids of the special tokens to leave out of the text, all but those in `keep`."""
    return frozenset(i for text, i in special_token_ids(tokenizer).items() if text not in keep)
