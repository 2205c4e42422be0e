"""IncrementalDetokenizer against tokenizer.decode on the real SmolLM2 tokenizer."""
from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.core.io_struct import BatchTokenIDOut
from radixserve.server.detokenizer_manager import DetokenizerManager
from radixserve.server.incremental_detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? Ünïcödé façade naïve",
    "你好，世界！今天天气很好。日本語のテキストも。",
    "emoji 🎉🚀👍🏽 and flags 🇫🇷 family 👨‍👩‍👧",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\nHey!<|im_end|>",
    "tabs\tand\nnewlines\n\n  spaces   and digits 1234567890",
    "Ελληνικά и русский текст, עברית, العربية",
]


def stream(tokenizer: Any, ids: list[int], chunks: list[int], **kwargs: Any) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas, pos = [], 0
    for size in chunks:
        if pos + size >= len(ids):
            break
        deltas.append(detok.append(ids[pos:pos + size]))
        pos += size
    deltas.append(detok.finish(ids[pos:]))
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("chunking", ["one", "random"])
def test_concatenation_equals_decode(smollm_tokenizer: Any, text: str,
                                     skip_special_tokens: bool, chunking: str) -> None:
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(len(text))
    chunks = [1 if chunking == "one" else rng.randint(1, 4) for _ in ids]
    deltas = stream(smollm_tokenizer, ids, chunks, skip_special_tokens=skip_special_tokens)
    expected = smollm_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    # nothing half-decoded is ever streamed: no delta holds a replacement character
    assert all("\ufffd" not in d for d in deltas[:-1])


def test_multibyte_char_waits_for_all_bytes(smollm_tokenizer: Any) -> None:
    ids = smollm_tokenizer.encode("a🎉", add_special_tokens=False)
    assert len(ids) >= 3, "the emoji must span several byte tokens for this test"
    detok = IncrementalDetokenizer(smollm_tokenizer)
    assert detok.append(ids[:1]) == "a"
    for i in range(1, len(ids) - 1):
        assert detok.append([ids[i]]) == ""
    assert detok.append([ids[-1]]) == "🎉"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=24),
       seed=st.integers(0, 1000))
def test_random_ids_property(smollm_tokenizer: Any, ids: list[int], seed: int) -> None:
    rng = random.Random(seed)
    chunks = [rng.randint(1, 3) for _ in ids]
    deltas = stream(smollm_tokenizer, ids, chunks, skip_special_tokens=True)
    assert "".join(deltas) == smollm_tokenizer.decode(ids, skip_special_tokens=True)


def run_until_stop(tokenizer: Any, ids: list[int], stop: str) -> tuple[list[str], list[int]]:
    """Feed tokens one by one and finish the way the scheduler does (the stop string appears in
    the decoded tail window; a string of B UTF-8 bytes spans at most B tokens)."""
    detok = IncrementalDetokenizer(tokenizer, stop_strs=[stop, "never-matches-xyz"])
    deltas: list[str] = []
    for n in range(1, len(ids) + 1):
        tail = tokenizer.decode(ids[:n][-(len(stop.encode()) + 1):], skip_special_tokens=True)
        if stop in tail:
            deltas.append(detok.finish([ids[n - 1]], stop))
            return deltas, ids[:n]
        deltas.append(detok.append([ids[n - 1]]))
    raise AssertionError("stop string never matched")


@pytest.mark.parametrize("text,stop", [
    ("One, two, three. Four, five.", "three"),
    ("Answer: 42\n\nNext question", "\n\n"),
    ("Il était une fois un château", "château"),
    ("数字一二三四五六", "三四"),
    ("abc abd abe", "abe"),
])
def test_stop_string_is_cut_and_never_streamed(smollm_tokenizer: Any, text: str,
                                               stop: str) -> None:
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    deltas, used = run_until_stop(smollm_tokenizer, ids, stop)
    full = smollm_tokenizer.decode(used, skip_special_tokens=True)
    assert "".join(deltas) == full[:full.find(stop)]
    streamed = ""
    for d in deltas:
        streamed += d
        assert stop not in streamed


def test_manager_frees_state_and_passes_other_messages(smollm_tokenizer: Any) -> None:
    manager = DetokenizerManager(smollm_tokenizer)
    ids = smollm_tokenizer.encode("Hello there, friend", add_special_tokens=False)

    def batch(new: list[list[int]], finished: list[Any]) -> BatchTokenIDOut:
        n = len(new)
        return BatchTokenIDOut(rids=["a", "b"][:n], new_output_ids=new, finished_reasons=finished,
                               meta_infos=[{}] * n, skip_special_tokens=[True] * n,
                               spaces_between_special_tokens=[True] * n, stop_strs=[[]] * n)

    out1 = manager.handle(batch([ids[:2], ids[:1]], [None, None]))
    out2 = manager.handle(batch([ids[2:], ids[1:]], [{"type": "length", "length": 9},
                                                    {"type": "abort", "message": "x"}]))
    assert out1.text_deltas[0] + out2.text_deltas[0] == smollm_tokenizer.decode(ids)
    assert out1.text_deltas[1] + out2.text_deltas[1] == smollm_tokenizer.decode(ids)
    assert manager.states == {}
    sentinel = object()
    assert manager.handle(sentinel) is sentinel


def test_a_request_that_fails_to_convert_ends_alone(smollm_tokenizer: Any) -> None:
    # a conversion error (here: a poisoned id) ends only its request: a 500 for its consumer,
    # marked still scheduled (the consumer aborts it there), its later messages dropped until
    # its finishing one; the process and the other requests go on
    poison = 7

    class Poisoned:
        def __getattr__(self, name: str) -> Any:
            return getattr(smollm_tokenizer, name)

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            if poison in ids:
                raise TypeError("bad state")
            return smollm_tokenizer.decode(ids, **kwargs)

    manager = DetokenizerManager(Poisoned())
    ids = smollm_tokenizer.encode("Hello there, friend", add_special_tokens=False)
    assert poison not in ids

    def batch(new: list[list[int]], finished: list[Any]) -> BatchTokenIDOut:
        return BatchTokenIDOut(rids=["ok", "bad"], new_output_ids=new,
                               finished_reasons=finished, meta_infos=[{}, {}],
                               skip_special_tokens=[True] * 2,
                               spaces_between_special_tokens=[True] * 2, stop_strs=[[], []])

    out1 = manager.handle(batch([ids[:2], [poison]], [None, None]))
    assert out1.rids == ["ok"]
    [error] = manager.take_errors()
    assert (error.rid, error.http_status, error.still_scheduled) == ("bad", 500, True)
    out2 = manager.handle(batch([ids[2:3], ids[:1]], [None, None]))
    assert out2.rids == ["ok"] and manager.take_errors() == []
    out3 = manager.handle(batch([ids[3:], []], [{"type": "length", "length": 9},
                                                {"type": "abort", "message": "aborted"}]))
    assert out3.rids == ["ok"]
    assert "".join(o.text_deltas[0] for o in (out1, out2, out3)) == smollm_tokenizer.decode(ids)
    assert manager.states == {} and manager.failed == set()


@pytest.mark.parametrize("text", TEXTS + ["<|im_start|>user\nhi café<|im_end|>"])
def test_token_bytes_join_into_the_text(smollm_tokenizer: Any, text: str) -> None:
    # OpenAI's logprob `bytes`: each token's own bytes, so the parts of a character split
    # over tokens (emoji, CJK) join into it, where decoding each token alone gives U+FFFD
    from radixserve.server.openai_chat import logprob_content
    from radixserve.server.tokenizer_utils import token_bytes

    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(smollm_tokenizer, ids)) == text.encode("utf-8")
    entries = [(-0.5, tid, smollm_tokenizer.decode([tid])) for tid in ids]
    tops = [[(-0.5, tid, smollm_tokenizer.decode([tid]))] for tid in ids]
    content = logprob_content(smollm_tokenizer, entries, tops)
    assert bytes(b for item in content for b in item["bytes"]) == text.encode("utf-8")
    assert [item["top_logprobs"][0]["bytes"] for item in content] == \
        [item["bytes"] for item in content]


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_stop_token_is_left_out_of_the_text_unless_asked(smollm_tokenizer: Any,
                                                           include_stop: bool,
                                                           skip_special_tokens: bool) -> None:
    """A request ended by a stop token (stop_token_ids, or EOS shown with
    skip_special_tokens false) does not return that token's text, as vLLM does not; vLLM's
    include_stop_str_in_output keeps it. The token id stays in the output ids."""
    ids = smollm_tokenizer.encode(" there was a wise old wizard", add_special_tokens=False)
    eos = smollm_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for stop_id in (ids[-1], eos):
        sent = ids[:-1] + [stop_id] if stop_id != eos else ids + [eos]
        detok = IncrementalDetokenizer(smollm_tokenizer, skip_special_tokens=skip_special_tokens,
                                       include_stop=include_stop)
        text = "".join(detok.append([t]) for t in sent[:-1]) + detok.finish(sent[-1:], stop_id)
        kept = sent if include_stop else sent[:-1]
        assert text == smollm_tokenizer.decode(kept, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text,stop", [("One, two, three. Four, five.", "three"),
                                       ("数字一二三四五六", "三四")])
def test_include_stop_keeps_the_stop_string(smollm_tokenizer: Any, text: str, stop: str) -> None:
    """include_stop_str_in_output: the text runs to the stop string's end, nothing past it
    (the stop string held back while streaming is released at the finish)."""
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm_tokenizer, stop_strs=[stop], include_stop=True)
    deltas: list[str] = []
    for n in range(1, len(ids) + 1):
        tail = smollm_tokenizer.decode(ids[:n][-(len(stop.encode()) + 1):])
        if stop in tail:
            deltas.append(detok.finish([ids[n - 1]], stop))
            break
        deltas.append(detok.append([ids[n - 1]]))
    full = smollm_tokenizer.decode(ids[:n])
    assert "".join(deltas) == full[:full.find(stop) + len(stop)]
