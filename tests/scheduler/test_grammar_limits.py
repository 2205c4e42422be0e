"""Slow grammars are bounded: the front ends' check gives up after its time limit (the parse
goes on in a daemon thread, shared by a request for the same grammar, at most a few at once),
and the scheduler ends a request whose grammar has not compiled in time."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.scheduler.grammar import manager as manager_module
from radixserve.scheduler.grammar import validation
from radixserve.server.request_lanes import asks_for_grammar


@pytest.fixture
def slow_parse(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """_parse_error blocked until `release` is set; `calls` counts the parses started."""
    state: dict[str, Any] = {"release": threading.Event(), "calls": 0}

    def parse(kind: str, text: str) -> str | None:
        state["calls"] += 1
        state["release"].wait(30)
        return None if text.startswith("ok") else "bad grammar"

    monkeypatch.setattr(validation, "_parse_error", parse)
    monkeypatch.setattr(validation, "_CHECKS", validation._Checks())
    yield state
    state["release"].set()


def test_a_slow_check_times_out_and_is_shared_then_cached(slow_parse: dict[str, Any]) -> None:
    started = time.monotonic()
    error = validation.grammar_error("regex", "ok-slow", timeout_s=0.2)
    assert error is not None and "took more than 0.2 s" in error
    assert time.monotonic() - started < 5
    # asked again while its parse still runs: the same parse, not a second one
    assert "took more than" in validation.grammar_error("regex", "ok-slow", timeout_s=0.1)
    assert slow_parse["calls"] == 1
    slow_parse["release"].set()
    for _ in range(100):  # the parse ends; its result is kept
        if validation.grammar_error("regex", "ok-slow", timeout_s=0.5) is None:
            break
    assert validation.grammar_error("regex", "ok-slow") is None
    assert validation.grammar_error("regex", "bad") == "bad grammar"
    assert slow_parse["calls"] == 2


def test_at_most_a_few_checks_run_at_once(slow_parse: dict[str, Any]) -> None:
    for i in range(validation.MAX_CHECKS_RUNNING):
        assert "took more than" in validation.grammar_error("ebnf", f"ok-{i}", timeout_s=0.05)
    busy = validation.grammar_error("ebnf", "ok-other", timeout_s=0.05)
    assert busy is not None and "still being checked" in busy
    assert slow_parse["calls"] == validation.MAX_CHECKS_RUNNING


def test_the_real_check_still_refuses_bad_grammars() -> None:
    assert validation.grammar_error("regex", "[a-z]+") is None
    assert validation.grammar_error("regex", "(unclosed") is not None
    assert validation.grammar_error("json_schema", '{"type": "object"}') is None


class _NeverCompiles:
    def request(self, key: Any) -> Future:
        return Future()  # never done


def test_a_grammar_not_compiled_in_time_ends_its_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    grammars = manager_module.GrammarManager(tokenizer=object(), vocab_size=10,
                                             stop_token_ids={0}, context_len=64)
    grammars._backend = _NeverCompiles()
    params = SamplingParams(max_new_tokens=4, regex="[a-z]+")
    params.normalize()
    req = Req("r", [1, 2], params)
    assert grammars.on_add(req) is None
    assert not grammars.ready(req) and not grammars.failed  # compiling: skipped for now
    monkeypatch.setattr(manager_module, "COMPILE_TIMEOUT_S", 0.0)
    assert not grammars.ready(req)
    assert [(r.rid, "took more than" in message) for r, message in grammars.failed] == \
        [("r", True)]
    assert req.grammar_future is None


def test_requests_that_may_carry_a_grammar_take_the_grammar_lane() -> None:
    assert asks_for_grammar({"messages": [], "response_format": {"type": "json_object"}})
    assert asks_for_grammar({"prompt": "a", "guided_regex": "[a-z]"})
    assert asks_for_grammar({"text": "a", "sampling_params": {"json_schema": "{}"}})
    assert asks_for_grammar({"text": ["a"], "sampling_params": [{}, {"regex": "a"}]})
    assert not asks_for_grammar({"prompt": "a", "max_tokens": 3})
    assert not asks_for_grammar({"text": "a", "sampling_params": {"max_new_tokens": 3}})
    assert not asks_for_grammar([1, 2])


def test_compiled_grammars_kept_are_bounded_by_count_and_bytes() -> None:
    """A server asked for ever new schemas keeps a bounded cache: ours drops the least recently
    used past its count or byte bound, and xgrammar's own (unbounded by default) is off."""
    import json

    from radixserve.loader.tokenizer import get_tokenizer
    from radixserve.scheduler.grammar.backend import GrammarBackend

    tokenizer = get_tokenizer(None)

    def schema(i: int) -> tuple[str, str]:
        return ("json_schema", json.dumps({"type": "object", "properties": {
            f"field_{i}_{j}": {"type": "string"} for j in range(5)}}))

    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_size=4)
    for i in range(6):
        backend.request(schema(i)).result(timeout=60)
    assert list(backend._cache) == [schema(i) for i in range(2, 6)]
    assert backend._compiler.get_cache_size_bytes() == 0
    one = backend.request(schema(5)).result().memory_size_bytes
    assert one > 10_000
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                             cache_bytes=int(2.5 * one))
    for i in range(6):
        backend.request(schema(i)).result(timeout=60)
    # bounded before each new compile: two done ones fit beside the newest
    assert list(backend._cache) == [schema(i) for i in range(3, 6)]
    assert backend.cached_bytes() <= 3 * one + 1000
    again = backend.request(schema(3))  # a hit moves it to the end, and compiles nothing
    assert again.done() and list(backend._cache)[-1] == schema(3)


def test_tensor_parallel_ranks_bound_the_cache_by_count_alone() -> None:
    """A grammar's size is known once it has compiled, which each rank reaches on its own
    clock: a byte bound would evict different grammars on different ranks."""
    grammars = manager_module.GrammarManager(tokenizer=object(), vocab_size=10,
                                             stop_token_ids={0}, context_len=64,
                                             replicated=True)
    assert grammars.backend._cache_bytes == -1
    plain = manager_module.GrammarManager(tokenizer=object(), vocab_size=10,
                                          stop_token_ids={0}, context_len=64)
    assert plain.backend._cache_bytes > 0
