"""Tokenizers built from GGUF metadata, checked against transformers' own GGUF conversion."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf import GGUFWriter
from transformers import PreTrainedTokenizerBase

from radixserve.loader.gguf_file import read_gguf
from radixserve.loader.gguf_loader import gguf_cache_folder
from radixserve.loader.tokenizer import get_tokenizer, load_gguf_tokenizer

TEXTS = [
    "Hello world! How are you today?",
    "Numbers 12345 and 3.14159, dates 2024-11-29.",
    "  leading spaces\n\n\ttabs and\r\nwindows newlines  ",
    "héllo wörld, 世界, Привет, 🙂👍🏽 emoji",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>radixserve<file_sep>x = [1, 2]",
    "def f(x):\n    return x ** 2  # comment",
]


@pytest.fixture(scope="module")
def reference_tokenizer(bundled_gguf: str) -> PreTrainedTokenizerBase:
    """transformers' GGUF tokenizer conversion (slow, ~5 s; built once per module)."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(bundled_gguf)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_bundled_tokenizer_matches_transformers_gguf_conversion(
        bundled_gguf: str, reference_tokenizer: PreTrainedTokenizerBase) -> None:
    ours = get_tokenizer(None)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference_tokenizer.encode(text), text
        assert ours.decode(ids) == text
    assert len(ours) == len(reference_tokenizer) == 49152
    messages = [{"role": "user", "content": "Hi there"}]
    ours_chat = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi there<|im_end|>" in ours_chat
    assert ours_chat.endswith("<|im_start|>assistant\n")
    assert ours_chat == reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_bundled_special_tokens(bundled_gguf: str) -> None:
    tok = get_tokenizer(bundled_gguf)
    meta = read_gguf(bundled_gguf).metadata
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == meta["tokenizer.ggml.eos_token_id"]
    assert tok.bos_token_id == meta["tokenizer.ggml.bos_token_id"]
    assert tok.pad_token_id == meta["tokenizer.ggml.padding_token_id"]
    assert tok.unk_token_id == meta["tokenizer.ggml.unknown_token_id"]
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # no BOS added
    # control tokens stay whole and are dropped by skip_special_tokens
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_tokenizer_is_cached_and_reloads_identically(bundled_gguf: str) -> None:
    built = load_gguf_tokenizer(bundled_gguf)
    folder = gguf_cache_folder(bundled_gguf) / "tokenizer"
    assert (folder / "tokenizer.json").is_file()
    cached = load_gguf_tokenizer(bundled_gguf)
    assert cached.chat_template == built.chat_template
    for text in TEXTS:
        assert cached.encode(text) == built.encode(text)
    assert cached.eos_token_id == built.eos_token_id


def _write_tokenizer_only_gguf(source: str, path: Path, add_bos: bool) -> Path:
    """A GGUF with the bundled vocabulary but other BOS settings, and no tensors."""
    meta = read_gguf(source).metadata
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(meta["tokenizer.chat_template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_add_bos_flag_prepends_bos(bundled_gguf: str, tmp_path: Path) -> None:
    with_bos = _write_tokenizer_only_gguf(bundled_gguf, tmp_path / "bos.gguf", add_bos=True)
    without = _write_tokenizer_only_gguf(bundled_gguf, tmp_path / "nobos.gguf", add_bos=False)
    ours = load_gguf_tokenizer(str(with_bos), use_cache=False)
    plain = load_gguf_tokenizer(str(without), use_cache=False)
    assert ours.add_bos_token and not plain.add_bos_token
    for text in TEXTS[:3]:
        assert ours.encode(text) == [1] + plain.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == plain.encode(text)
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == text


def test_cache_entry_follows_file_changes(bundled_gguf: str, tmp_path: Path) -> None:
    path = _write_tokenizer_only_gguf(bundled_gguf, tmp_path / "t.gguf", add_bos=False)
    before = gguf_cache_folder(str(path))
    assert load_gguf_tokenizer(str(path)).encode("hi")[0] != 1
    _write_tokenizer_only_gguf(bundled_gguf, path, add_bos=True)
    os.utime(path, ns=(1, 1))  # make sure mtime differs even on coarse clocks
    assert gguf_cache_folder(str(path)) != before
    assert load_gguf_tokenizer(str(path)).encode("hi")[0] == 1


def test_a_processor_chat_template_serves_a_tokenizer_without_one(bundled_gguf: str,
                                                                   tmp_path: Path) -> None:
    """Multimodal repos (Gemma-3, Mistral Small 3.1) may keep the chat template only in the
    processor's chat_template.json: the tokenizer takes it from there, and its own wins."""
    import json as json_module
    from radixserve.loader.tokenizer import get_tokenizer
    tokenizer = get_tokenizer(bundled_gguf)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(
        json_module.dumps({"architectures": ["LlamaForCausalLM"]}))
    for leftover in tmp_path.glob("chat_template.jinja"):
        leftover.unlink()
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "chat_template.json").write_text(json_module.dumps({"chat_template": template}))
    loaded = get_tokenizer(str(tmp_path))
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}],
                                      tokenize=False) == "[hi]"
    (tmp_path / "chat_template.jinja").write_text("own")
    assert get_tokenizer(str(tmp_path)).chat_template == "own"
