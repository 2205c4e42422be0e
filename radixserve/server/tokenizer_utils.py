"""Loading the tokenizer for the server processes, and small decoding helpers."""
from __future__ import annotations

import functools
import re
from typing import Any

from radixserve.config import ServerArgs


def load_tokenizer(server_args: ServerArgs) -> Any | None:
    """The tokenizer the server uses, or None with --skip-tokenizer-init (input_ids only)."""
    if server_args.skip_tokenizer_init:
        return None
    from radixserve.loader.tokenizer import model_tokenizer

    return model_tokenizer(server_args.tokenizer_path, server_args.model_path, required=True)


def token_texts(tokenizer: Any | None, token_ids: list[int]) -> list[str | None]:
    """Each token decoded on its own (what OpenAI reports as `token`); None without tokenizer.
    A token that holds only part of a UTF-8 character decodes to U+FFFD."""
    if tokenizer is None:
        return [None] * len(token_ids)
    return [tokenizer.decode([tid], skip_special_tokens=False) for tid in token_ids]


def token_bytes(tokenizer: Any | None, token_ids: list[int]) -> list[bytes | None]:
    """Each token's own UTF-8 bytes (OpenAI's logprob `bytes`: a token holding part of a
    character has that part, so the bytes of consecutive tokens join into the text); None
    without tokenizer. Byte-level BPE pieces map back through GPT-2's byte alphabet,
    SentencePiece byte pieces (<0xE6>) are their byte, other pieces their text with the
    word-boundary mark as a space; added tokens are their text."""
    if tokenizer is None:
        return [None] * len(token_ids)
    added, byte_level = _byte_decoding(tokenizer)
    alphabet = _byte_alphabet()
    out: list[bytes | None] = []
    for tid, piece in zip(token_ids, tokenizer.convert_ids_to_tokens(list(token_ids))):
        if tid in added:
            out.append(added[tid])
        elif piece is None:
            out.append(b"")
        elif byte_level and all(c in alphabet for c in piece):
            out.append(bytes(alphabet[c] for c in piece))
        elif (match := _BYTE_PIECE.fullmatch(piece)) is not None:
            out.append(bytes([int(match.group(1), 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=8)
def _byte_decoding(tokenizer: Any) -> tuple[dict[int, bytes], bool]:
    """What token_bytes needs of a tokenizer, read once per tokenizer (transformers rebuilds
    `added_tokens_decoder` on every access): the added tokens' bytes, and whether the
    vocabulary is byte-level BPE."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return ({int(tid): str(token).encode("utf-8") for tid, token in added.items()},
            backend is not None and "ByteLevel" in repr(backend.decoder))


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves,
    the others (controls, space, ...) for 256 + their rank among them."""
    printable = [b for b in range(256)
                 if ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + rank): b for rank, b in enumerate(others)})
    return alphabet


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
