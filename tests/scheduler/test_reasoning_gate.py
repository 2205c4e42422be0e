"""A thinking model's grammar constrains only its answer (scheduler/grammar/matcher.py
`ReasoningGate`, server/reasoning.py `reasoning_gate`): real xgrammar matchers over the bundled
tokenizer with <think> and </think> added as single tokens."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.scheduler.grammar.matcher import ReasoningGate, RequestGrammar
from radixserve.server.reasoning import get_format, reasoning_gate

xgrammar = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def setup() -> tuple[Any, Any, int, int]:
    from radixserve.loader.tokenizer import get_tokenizer
    from radixserve.scheduler.grammar.backend import GrammarBackend

    tokenizer = get_tokenizer("SmolLM2-135M-Instruct")
    tokenizer.add_tokens(["<think>", "</think>"])
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = backend.request(("regex", "[0-9]{2}")).result(timeout=120)
    backend.shutdown()
    return tokenizer, compiled, start, end


def _allowed(grammar: RequestGrammar, vocab: int) -> set[int]:
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    grammar.fill_mask(mask, 0)
    bits = torch.stack([(mask[0] >> b) & 1 for b in range(32)], dim=1).reshape(-1)[:vocab]
    return set(torch.nonzero(bits).flatten().tolist())


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_thinking_is_free_and_the_end_tag_opens_the_grammar(setup) -> None:
    tokenizer, compiled, start, end = setup
    vocab = len(tokenizer)
    grammar = RequestGrammar(compiled, ReasoningGate(start, end, "thinking"))
    assert len(_allowed(grammar, vocab)) == vocab  # anything while thinking
    for token in _ids(tokenizer, "Let me see, hello") + [start]:
        assert grammar.accept(token) and not grammar.fed_last
    assert not grammar.terminated and grammar.forced_text() == ""
    assert grammar.accept(end) and grammar.active and not grammar.fed_last
    digits = _allowed(grammar, vocab)
    assert _ids(tokenizer, "4")[0] in digits and _ids(tokenizer, "a")[0] not in digits
    assert start not in digits and len(digits) < vocab // 10
    assert grammar.accept(_ids(tokenizer, "4")[0]) and grammar.fed_last
    assert not grammar.accept(_ids(tokenizer, "x")[0])  # the answer is constrained


def test_undecided_first_token_opens_a_block_or_starts_the_answer(setup) -> None:
    tokenizer, compiled, start, end = setup
    vocab = len(tokenizer)
    gate = ReasoningGate(start, end, "undecided")
    grammar = RequestGrammar(compiled, gate)
    first = _allowed(grammar, vocab)
    assert start in first and _ids(tokenizer, "7")[0] in first
    assert _ids(tokenizer, "a")[0] not in first
    assert grammar.accept(start) and grammar.state == "thinking"
    answer = RequestGrammar(compiled, gate)
    assert answer.accept(_ids(tokenizer, "7")[0]) and answer.fed_last and answer.active
    assert start not in _allowed(answer, vocab)


def test_replay_rebuilds_the_gate_and_the_matcher(setup) -> None:
    tokenizer, compiled, start, end = setup
    output = [start] + _ids(tokenizer, "hmm") + [end] + _ids(tokenizer, "4")
    grammar = RequestGrammar(compiled, ReasoningGate(start, end, "undecided"))
    assert grammar.replay(output) and grammar.active
    fresh = RequestGrammar(compiled)
    assert fresh.accept(_ids(tokenizer, "4")[0])
    assert _allowed(grammar, len(tokenizer)) == _allowed(fresh, len(tokenizer))


def test_the_gate_for_a_prompt(setup) -> None:
    tokenizer, _, start, end = setup
    r1, qwen3 = get_format("deepseek-r1"), get_format("qwen3")
    plain = "user: hi\nassistant:"
    assert reasoning_gate(r1, tokenizer, plain) == (start, end, "thinking")
    assert reasoning_gate(qwen3, tokenizer, plain) == (start, end, "undecided")
    # the template opened the block: the output starts inside it
    assert reasoning_gate(qwen3, tokenizer, plain + "<think>\n") == (start, end, "thinking")
    # the template closed it (thinking switched off): the grammar applies from the start
    assert reasoning_gate(qwen3, tokenizer, plain + "<think>\n\n</think>\n\n") is None
    assert reasoning_gate(r1, tokenizer, plain + "<think></think>") is None


def test_no_gate_where_a_tag_is_several_tokens() -> None:
    from radixserve.loader.tokenizer import get_tokenizer
    tokenizer = get_tokenizer("SmolLM2-135M-Instruct")  # <think> is several pieces here
    assert reasoning_gate(get_format("qwen3"), tokenizer, "user: hi") is None
