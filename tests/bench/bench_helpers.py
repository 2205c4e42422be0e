"""Shared helpers for the benchmark tests: a real (tiny) word-level tokenizer."""
from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(200)]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """One token per whitespace-separated word w0..w199; ids 0-2 are special."""
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>",
                                   eos_token="</s>")
