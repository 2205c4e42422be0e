"""Constrained decoding through the offline Engine (the server's scheduler) on the bundled
model: jump-forward, retraction, chunked prefill and overlap with grammars; outputs always
match their grammar and the KV accounting holds afterwards."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixserve import Engine

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "city"]}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"


def _assert_memory_ok(engine: Engine) -> None:
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0


def test_jump_forward_outputs_match_and_skip_passes() -> None:
    with Engine(enable_jump_forward=True) as engine:
        outs = engine.generate(["A person as JSON:", "Another person:"], {
            "max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(PERSON)})
        for out in outs:
            jsonschema.validate(json.loads(out["text"]), PERSON)
        # the fixed keys and punctuation were appended without a pass per token
        assert engine.scheduler.grammars.num_jumped_tokens > 0
        date = engine.generate("Today's date:", {"max_new_tokens": 16, "temperature": 0,
                                                 "regex": DATE})
        assert re.fullmatch(DATE, date["text"])
        # min_new_tokens beyond the grammar's end: the grammar wins (its stop token ends the
        # request), rather than tokens the grammar refuses
        for temperature in (0, 0.9):
            short = engine.generate("hi", {"max_new_tokens": 6, "min_new_tokens": 4,
                                           "temperature": temperature, "regex": "a"})
            assert short["text"] == "a"
            assert short["meta_info"]["finish_reason"]["type"] == "stop"
            assert short["meta_info"]["completion_tokens"] == 2  # "a", then the stop token
        _assert_memory_ok(engine)


WORDS = r"[a-z]{3,8}( [a-z]{3,8}){8,12}"


# synchronous steps are the simpler case: the default (overlap) one runs in CI
@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["overlap", "no-overlap"])
def test_retraction_and_chunked_prefill_keep_grammars(overlap: bool) -> None:
    # a KV cache too small for every request's growth and an optimistic admission: decode
    # retracts some requests, which return to the queue with their output (their matcher
    # stays in step with it); prompts are prefilled in chunks of 16
    with Engine(max_total_tokens=160, schedule_conservativeness=0.05, chunked_prefill_size=16,
                disable_overlap_schedule=not overlap) as engine:
        params = [{"max_new_tokens": 48, "temperature": 0.8, "seed": i,
                   **({"json_schema": json.dumps(PERSON)} if i % 2 else {"regex": WORDS})}
                  for i in range(8)]
        outs = engine.generate([f"Request {i}: write a person as JSON, or some words."
                                for i in range(8)], params)
        for i, out in enumerate(outs):
            if i % 2:
                jsonschema.validate(json.loads(out["text"]), PERSON)
            else:
                assert re.fullmatch(WORDS, out["text"]), out["text"]
        assert engine.get_internal_state()["num_retractions"] > 0
        _assert_memory_ok(engine)
