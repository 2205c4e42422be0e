"""Grammar plumbing in the scheduler, with the fake runner and a stub grammar backend whose
compilations the test finishes by hand: a request waits in the queue for its grammar without
holding up others, then runs; a failed compilation ends the request with the error; the
batch's mask is applied before sampling (own bitmask code vs xgrammar's)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from radixserve.executor.vocab_mask import apply_vocab_mask
from tests.scheduler.fake_runner import (assert_memory_clean, expected_output, make_req,
                                         make_scheduler, run_all)


class StubGrammar:
    """Allows every token; counts what it accepted."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        pass

    def forced_text(self) -> str:
        return ""

    @property
    def terminated(self) -> bool:
        return False


class StubBackend:
    def __init__(self) -> None:
        self.futures: dict[tuple[str, str], Future[Any]] = {}
        self.gates: list[Any] = []  # the reasoning gate each matcher was given

    def request(self, key: tuple[str, str]) -> Future[Any]:
        return self.futures.setdefault(key, Future())

    def new_matcher(self, compiled: Any, gate: Any = None) -> StubGrammar:
        self.gates.append(gate)
        return StubGrammar()


def _scheduler_with_stub() -> tuple[Any, StubBackend]:
    scheduler, _ = make_scheduler()
    backend = StubBackend()
    scheduler.grammars.tokenizer = object()  # the fake model has none; the stub needs none
    scheduler.grammars._backend = backend
    return scheduler, backend


def test_request_waits_for_its_grammar_without_blocking_others() -> None:
    scheduler, backend = _scheduler_with_stub()
    assert scheduler.add_request(make_req("constrained", [5, 6, 7], regex="a+")) is None
    assert scheduler.add_request(make_req("plain", [8, 9], max_new=4)) is None
    results = {}
    for _ in range(20):
        for out in scheduler.run_turn():
            results.update({rid: r for rid, r in zip(out.rids, out.finished_reasons) if r})
    assert "plain" in results and "constrained" not in results
    assert [r.rid for r in scheduler.waiting_queue] == ["constrained"]
    backend.futures[("regex", "a+")].set_result("compiled")
    done = run_all(scheduler)
    assert done["constrained"]["ids"] == expected_output([5, 6, 7], 8)
    assert_memory_clean(scheduler)


def test_failed_compilation_ends_the_request_with_its_error() -> None:
    scheduler, backend = _scheduler_with_stub()
    scheduler.add_request(make_req("bad", [5, 6], json_schema='{"type": "object"}'))
    backend.futures[("json_schema", '{"type": "object"}')].set_exception(
        RuntimeError("no such type"))
    done = run_all(scheduler)
    assert done["bad"]["finish"]["type"] == "abort"
    assert "invalid json_schema: no such type" in done["bad"]["finish"]["message"]
    assert_memory_clean(scheduler)


def test_no_tokenizer_refuses_grammar_requests() -> None:
    scheduler, _ = make_scheduler()
    error = scheduler.add_request(make_req("r", [5], ebnf='root ::= "a"'))
    assert error is not None and "needs a tokenizer" in error.message


def test_vocab_mask_matches_xgrammar() -> None:
    import xgrammar

    generator = torch.Generator().manual_seed(0)
    for batch, vocab in ((1, 31), (3, 64), (4, 1000)):
        words = (vocab + 31) // 32
        mask = torch.randint(-2**31, 2**31 - 1, (batch, words), dtype=torch.int32,
                             generator=generator)
        logits = torch.randn(batch, vocab, generator=generator)
        expected = logits.clone()
        xgrammar.apply_token_bitmask_inplace(expected, mask, vocab_size=vocab)
        got = apply_vocab_mask(logits, mask)
        assert torch.equal(got, expected)
        assert not torch.isinf(logits).any()  # the input is left as it was


def test_a_thinking_requests_matcher_gets_its_reasoning_gate() -> None:
    from radixserve.scheduler.grammar.matcher import ReasoningGate
    scheduler, backend = _scheduler_with_stub()
    req = make_req("thinks", [5, 6, 7], regex="a+")
    req.sampling_params.reasoning_gate = (11, 12, "thinking")
    scheduler.add_request(req)
    scheduler.add_request(make_req("plain", [5, 6], regex="a+"))
    backend.futures[("regex", "a+")].set_result("compiled")
    run_all(scheduler)
    assert backend.gates == [ReasoningGate(11, 12, "thinking"), None]
