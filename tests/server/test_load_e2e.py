"""200 concurrent streaming clients, a third of which hang up mid-stream; then the scheduler
must be idle with zero leaked KV slots. Also: a non-streaming client that hangs up is aborted."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import requests

NUM_CLIENTS = 200
PROMPTS = [f"Write a short note number {i} about" for i in range(7)]


def abort_count(server: Any) -> float:
    text = requests.get(server.url("/metrics"), headers=server.headers, timeout=60).text
    for line in text.splitlines():
        if line.startswith("radixserve:request_success_total") and 'finish_reason="abort"' in line:
            return float(line.split()[-1])
    return 0.0


async def one_client(session: aiohttp.ClientSession, url: str, i: int) -> dict[str, Any]:
    hang_up = i % 3 == 0
    body = {"text": PROMPTS[i % len(PROMPTS)], "stream": True,
            "sampling_params": {"max_new_tokens": 48 if hang_up else 10, "temperature": 0,
                                "ignore_eos": True}}
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        chunks: list[dict[str, Any]] = []
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return {"hung_up": False, "chunks": chunks}
            chunks.append(json.loads(line[len("data: "):]))
            if hang_up and len(chunks) >= 2:
                response.close()  # drop the connection mid-stream
                return {"hung_up": True, "chunks": chunks}
    raise AssertionError("stream ended without [DONE]")


async def run_clients(server: Any) -> list[dict[str, Any]]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(headers=server.headers, connector=connector,
                                     timeout=timeout) as session:
        return await asyncio.gather(*(one_client(session, server.url("/generate"), i)
                                      for i in range(NUM_CLIENTS)))


def test_concurrent_streams_with_disconnects(server: Any, smollm_tokenizer: Any) -> None:
    aborts_before = abort_count(server)
    results = asyncio.run(run_clients(server))
    completed = [r for r in results if not r["hung_up"]]
    assert len(completed) == NUM_CLIENTS - len(range(0, NUM_CLIENTS, 3))
    for result in completed:
        final = result["chunks"][-1]
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        assert len(final["output_ids"]) == final["meta_info"]["completion_tokens"] == 10
        assert final["text"] == smollm_tokenizer.decode(final["output_ids"],
                                                        skip_special_tokens=True)
    # greedy and same prompt -> the same tokens, whatever batch each request landed in
    by_prompt: dict[str, set[tuple[int, ...]]] = {}
    for i, result in enumerate(results):
        if not result["hung_up"]:
            ids = tuple(result["chunks"][-1]["output_ids"])
            by_prompt.setdefault(PROMPTS[i % len(PROMPTS)], set()).add(ids)
    assert all(len(outputs) == 1 for outputs in by_prompt.values()), by_prompt
    info = server.wait_idle_memory_check()
    state = info["internal_state"]
    assert info["num_in_flight_requests"] == 0
    assert state["memory_check_ok"] is True and state["leaked_tokens"] == 0
    assert state["num_running_reqs"] == 0 and state["num_queued_reqs"] == 0
    assert abort_count(server) >= aborts_before + len(range(0, NUM_CLIENTS, 3))
    # still serving
    response = requests.post(server.url("/generate"), headers=server.headers, timeout=120,
                             json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 200


def test_non_streaming_client_disconnect_aborts(server: Any) -> None:
    before = abort_count(server)
    try:
        requests.post(server.url("/generate"), headers=server.headers, timeout=1.5,
                      json={"text": "Tell me everything", "sampling_params": {
                          "max_new_tokens": 4000, "ignore_eos": True}})
        raise AssertionError("the request should not finish within the client's timeout")
    except requests.exceptions.ReadTimeout:
        pass
    for _ in range(120):
        if abort_count(server) >= before + 1:
            break
        time.sleep(0.5)
    assert abort_count(server) >= before + 1
    info = server.wait_idle_memory_check()
    assert info["internal_state"]["memory_check_ok"] is True
    assert info["internal_state"]["leaked_tokens"] == 0
