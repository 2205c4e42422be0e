"""Build a transformers fast tokenizer from a GGUF file's `tokenizer.*` metadata.

A GGUF carries no tokenizer.json; it stores the vocabulary, merges, token types, special token
ids, BOS/EOS flags and the chat template as metadata. For byte-level BPE vocabularies
(`tokenizer.ggml.model == "gpt2"`) we assemble the `tokenizers` pipeline directly, picking the
pre-tokenizer the way llama.cpp does from `tokenizer.ggml.pre`. Any other tokenizer model
(sentencepiece, ...) falls back to transformers' own GGUF conversion, which is slower but general.
"""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from radixserve.loader.gguf_file import GGUFFile

# llama.cpp token types
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    # StarCoder-family vocabularies (SmolLM, ...): every digit is its own piece, then GPT-2's regex
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _llama3_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre -> the pre-tokenizer llama.cpp uses for it (byte-level BPE only)
PRE_TOKENIZERS = {
    "default": _gpt2_split, "gpt2": _gpt2_split, "gpt-2": _gpt2_split, "mpt": _gpt2_split,
    "olmo": _gpt2_split,
    "smollm": _digits_then_gpt2_split, "starcoder": _digits_then_gpt2_split,
    "refact": _digits_then_gpt2_split, "codeshell": _digits_then_gpt2_split,
    "llama3": _llama3_split, "llama-v3": _llama3_split, "llama-bpe": _llama3_split,
    "smaug-bpe": _llama3_split, "dbrx": _llama3_split,
}


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _spell_byte_level(tokens: list[str]) -> list[str]:
    """Tokens as the byte-level BPE model spells them; a token written in raw UTF-8 (some
    converters do that) is re-spelled byte by byte."""
    table = _byte_level_alphabet()
    alphabet = set(table.values())
    return [tok if set(tok) <= alphabet else "".join(table[b] for b in tok.encode("utf-8"))
            for tok in tokens]


def supports_fast_build(meta: dict[str, Any]) -> bool:
    return (meta.get("tokenizer.ggml.model") == "gpt2"
            and meta.get("tokenizer.ggml.pre", "default") in PRE_TOKENIZERS
            and "tokenizer.ggml.merges" in meta)


def _post_processor(tokens: list[str], bos_id: int | None, eos_id: int | None,
                    add_bos: bool, add_eos: bool) -> processors.PostProcessor:
    if not (add_bos and bos_id is not None) and not (add_eos and eos_id is not None):
        return processors.ByteLevel(trim_offsets=False)
    prefix = [(tokens[bos_id], bos_id)] if add_bos and bos_id is not None else []
    suffix = [(tokens[eos_id], eos_id)] if add_eos and eos_id is not None else []
    single = [t for t, _ in prefix] + ["$A:0"] + [t for t, _ in suffix]
    pair = single + [t for t, _ in prefix] + ["$B:1"] + [t for t, _ in suffix]
    specials = list(dict.fromkeys(prefix + suffix))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def build_byte_level_tokenizer(gguf: GGUFFile) -> PreTrainedTokenizerFast:
    """A fast tokenizer for a byte-level BPE GGUF vocabulary (see `supports_fast_build`)."""
    meta = gguf.metadata
    tokens = _spell_byte_level(list(meta["tokenizer.ggml.tokens"]))
    token_types = list(meta.get("tokenizer.ggml.token_type") or [])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre", "default")]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, token_types) if kind == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED])

    def token_of(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tok.post_processor = _post_processor(tokens, bos_id, eos_id, add_bos, add_eos)
    arch = meta.get("general.architecture", "")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token_of("bos_token_id"),
        eos_token=token_of("eos_token_id"),
        unk_token=token_of("unknown_token_id"),
        pad_token=token_of("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=int(meta.get(f"{arch}.context_length", 1 << 30)),
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
    )


def build_tokenizer_with_transformers(gguf_path: str) -> PreTrainedTokenizerBase:
    """Fallback: transformers' own GGUF tokenizer conversion (any tokenizer model it knows)."""
    import os

    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


def build_gguf_tokenizer(gguf: GGUFFile) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF file describes, with its chat template and special tokens."""
    if supports_fast_build(gguf.metadata):
        return build_byte_level_tokenizer(gguf)
    return build_tokenizer_with_transformers(gguf.path)
