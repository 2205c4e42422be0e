"""A request's priority through the front ends: refused by name (400) on a server that does
not schedule by priority (the shared server), accepted by an Engine that does, whose outputs
are those of the same requests without priorities (greedy)."""
from __future__ import annotations

from typing import Any

import openai
import pytest
import requests

import radixserve
from tests.models.tiny_checkpoints import make_checkpoint


def test_a_priority_without_priority_scheduling_is_a_400(server: Any, openai_client: Any,
                                                         model_name: str) -> None:
    reply = requests.post(server.url("/generate"), headers=server.headers, timeout=60, json={
        "text": "Hi", "priority": 3, "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 400 and "--enable-priority-scheduling" in reply.text
    assert reply.json()["error"]["param"] == "priority"
    with pytest.raises(openai.BadRequestError, match="enable-priority-scheduling"):
        openai_client.chat.completions.create(
            model=model_name, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
            extra_body={"priority": 3})


def test_an_engine_with_priority_scheduling_takes_priorities(tmp_path) -> None:
    make_checkpoint("llama_gqa_llama3_rope", tmp_path / "model")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    engine = radixserve.Engine(str(tmp_path / "model"), skip_tokenizer_init=True,
                               dtype="float32", device="cpu", max_total_tokens=500,
                               enable_priority_scheduling=True, max_running_requests=1)
    try:
        plain = engine.generate(input_ids=prompts, sampling_params=greedy)
        ranked = engine.generate(input_ids=prompts, sampling_params=greedy,
                                 priority=[0, 20, 5])
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in ranked] == [o["output_ids"] for o in plain]
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
