"""The reasoning split (server/reasoning.py): finished outputs of both formats, and streams
whose deltas, cut anywhere (inside a tag too), join to the finished split."""
from __future__ import annotations

import pytest

from radixserve.server.reasoning import (ReasoningSplit, ReasoningStream, get_format,
                                        plan_split, split_reasoning)

R1, QWEN3 = get_format("deepseek-r1"), get_format("qwen3")


@pytest.mark.parametrize("fmt,text,expected", [
    (QWEN3, "<think>\nLet me add.\n</think>\n\n4", ("Let me add.", "4")),
    (QWEN3, "4", (None, "4")),  # thinking switched off
    (QWEN3, "\n4 </think> x", (None, "\n4 </think> x")),  # decided by the opening
    (QWEN3, "<think>\n\n</think>\n\nHi", ("", "Hi")),  # an empty block
    (QWEN3, "<think>cut off by max_tokens", ("cut off by max_tokens", "")),
    (R1, "Let me add.\n</think>\n\n4", ("Let me add.", "4")),  # the prompt opened it
    (R1, "<think>a</think>b", ("a", "b")),
    (R1, "still thinking", ("still thinking", "")),
    (R1, "a</think>", ("a", "")),
])
def test_finished_outputs(fmt, text: str, expected: tuple) -> None:
    assert split_reasoning(fmt, text) == expected


@pytest.mark.parametrize("fmt", [R1, QWEN3])
@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("text", [
    "<think>\nStep one.\nStep </thin two.\n</think>\n\nThe answer is <b>4</b>.",
    "<think></think>Hi",
    "<thinking is not the tag",
    "  \n<think> x </think>",
    "<think>never closed </thi",
    "plain answer, < and </ and </think",
])
def test_stream_deltas_join_to_the_finished_split(fmt, inside: bool, text: str) -> None:
    final_reasoning, final_answer = split_reasoning(fmt, text, inside=inside)
    for step in (1, 2, 3, 7):
        stream = ReasoningStream(ReasoningSplit(fmt, inside))
        reasoning, answers = "", [""]
        for end in list(range(step, len(text), step)) + [len(text)]:
            delta, answer = stream.update(text[:end], final=end == len(text))
            reasoning += delta
            assert answer.startswith(answers[-1])  # the answer only grows
            answers.append(answer)
        assert reasoning == (final_reasoning or "")
        assert answers[-1] == final_answer


@pytest.mark.parametrize("fmt", [R1, QWEN3])
def test_a_block_the_prompt_opened(fmt) -> None:
    """continue_final_message after "<think>", or a template that opens the block: the output
    is reasoning until </think>, whatever the format."""
    assert split_reasoning(fmt, "  so 2 + 2 </think>\n4", inside=True) == ("so 2 + 2", "4")
    assert split_reasoning(fmt, "still going", inside=True) == ("still going", "")
    split = plan_split(fmt, "<|user|>2+2?<|assistant|><think>", False, None)
    assert split == ReasoningSplit(fmt, inside=True)
    closed = "<|assistant|><think>\n\n</think>\n\n"  # thinking switched off
    assert plan_split(fmt, closed, False, None) == ReasoningSplit(fmt, inside=False)


def test_a_grammar_from_the_first_token_leaves_no_reasoning() -> None:
    """Without a gate (tags of several tokens, or a block the prompt closed) a constrained
    output is all answer: a forced tool call or JSON never lands in reasoning_content."""
    assert plan_split(R1, "prompt", constrained=True, gate=None) is None
    assert plan_split(R1, "prompt", True, (5, 6, "thinking")) == ReasoningSplit(R1)
    assert plan_split(None, "prompt", False, None) is None


def test_unknown_format_names_the_known_ones() -> None:
    assert get_format("deepseek_r1") is R1  # vLLM's spelling
    with pytest.raises(ValueError, match="qwen3"):
        get_format("o1")


def test_chat_requests_keep_the_tags_and_gate_their_grammar() -> None:
    """A tokenizer where <think> / </think> are special tokens: with a reasoning parser the
    chat request keeps them in its output text (else decoding drops them and nothing splits),
    and a grammar constrains only the answer; without a parser, or with separate_reasoning
    false, nothing changes."""
    from types import SimpleNamespace

    from radixserve.loader.tokenizer import get_tokenizer
    from radixserve.server.openai_chat import build_requests
    from radixserve.server.openai_common import OpenAIContext
    from radixserve.core.request_validation import RequestLimits
    from radixserve.server.openai_protocol import ChatCompletionRequest

    tokenizer = get_tokenizer("SmolLM2-135M-Instruct")
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    manager = SimpleNamespace(tokenizer=tokenizer, limits=RequestLimits(8192, len(tokenizer)),
                              generation_defaults={},
                              make_request=lambda **kw: SimpleNamespace(**kw))

    def params(reasoning, **fields):
        ctx = OpenAIContext(manager, "m", frozenset(), reasoning=reasoning)  # type: ignore
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "2 + 2?"}], **fields})
        reqs, _, _ = build_requests(ctx, body)
        return reqs[0].sampling_params

    assert params(QWEN3).keep_special_tokens == ("<think>", "</think>")
    assert params(None).keep_special_tokens == ()
    assert params(QWEN3, separate_reasoning=False).keep_special_tokens == ()
    # a grammar waits for the reasoning: the matcher gets the tags' ids
    json_mode = {"response_format": {"type": "json_object"}}
    assert params(QWEN3, **json_mode).reasoning_gate == (start, end, "undecided")
    assert params(R1, **json_mode).reasoning_gate == (start, end, "thinking")
    assert params(QWEN3).reasoning_gate is None and params(None, **json_mode).reasoning_gate \
        is None


def test_an_empty_block_is_no_reasoning_streamed_or_not() -> None:
    """"</think>" first (deepseek-r1, the prompt opened the block): the answer's
    reasoning_content is null, as its stream sends no reasoning delta (a probe found "")."""
    from radixserve.server.openai_chat import choice_of
    from radixserve.server.openai_protocol import ChatCompletionRequest
    from radixserve.server.openai_tools import plan_tools
    from radixserve.server.request_state import ReqOutput
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    out = ReqOutput("r", "</think>The answer.", [], {"finish_reason": {"type": "stop"}}, True)
    split = ReasoningSplit(get_format("deepseek-r1"), inside=True)
    message = choice_of(body, plan_tools(body, None, None), 0, out, None, split)["message"]
    assert message["reasoning_content"] is None and message["content"] == "The answer."
