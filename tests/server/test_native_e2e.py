"""The native API (/generate and the control routes) against the real server."""
from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import requests

from tests.server.native_client import PROMPT, greedy, post, sse_events


def test_generate_text_and_input_ids_agree(server: Any, smollm_tokenizer: Any) -> None:
    by_text = post(server, "/generate", {"text": PROMPT, "sampling_params": greedy(10)}).json()
    ids = smollm_tokenizer.encode(PROMPT)
    by_ids = post(server, "/generate", {"input_ids": ids, "sampling_params": greedy(10)}).json()
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["text"] == by_ids["text"]
    assert by_text["text"] == smollm_tokenizer.decode(by_text["output_ids"],
                                                      skip_special_tokens=True)
    meta = by_text["meta_info"]
    assert meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == len(by_text["output_ids"])
    assert set(meta) >= {"id", "cached_tokens", "finish_reason"}


def test_batched_generate_equals_single(server: Any) -> None:
    prompts = [PROMPT, "The best way to learn", "def fibonacci(n):"]
    batch = post(server, "/generate", {"text": prompts, "sampling_params": greedy(8)}).json()
    assert isinstance(batch, list) and len(batch) == 3
    for prompt, out in zip(prompts, batch):
        single = post(server, "/generate", {"text": prompt, "sampling_params": greedy(8)}).json()
        assert out["output_ids"] == single["output_ids"]


def test_stream_generate_cumulative(server: Any) -> None:
    full = post(server, "/generate", {"text": PROMPT, "sampling_params": greedy(12)}).json()
    response = post(server, "/generate", {"text": PROMPT, "sampling_params": greedy(12),
                                          "stream": True}, stream=True)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 1
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "text is cumulative"
    assert texts[-1] == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]


def test_generate_logprobs(server: Any) -> None:
    out = post(server, "/generate", {"text": PROMPT, "sampling_params": greedy(5),
                                     "return_logprob": True, "top_logprobs_num": 2,
                                     "logprob_start_len": 0,
                                     "return_text_in_logprobs": True}).json()
    meta = out["meta_info"]
    tokens = meta["output_token_logprobs"]
    assert [t[1] for t in tokens] == out["output_ids"]
    for (lp, tid, _), top in zip(tokens, meta["output_top_logprobs"]):
        assert top[0][1] == tid and abs(top[0][0] - lp) < 1e-4  # greedy picks the top token
    # logprob_start_len 0: one entry per prompt token, the first without a logprob
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None


def test_abort_request_route(server: Any) -> None:
    rid = "abort-me-please"
    events: list[Any] = []

    def consume() -> None:
        response = post(server, "/generate", {"text": PROMPT, "rid": rid, "stream": True,
                                              "sampling_params": {"max_new_tokens": 2000,
                                                                  "ignore_eos": True}},
                        stream=True)
        events.extend(sse_events(response))

    thread = threading.Thread(target=consume)
    thread.start()
    for _ in range(600):
        if server.server_info()["num_in_flight_requests"] > 0:
            break
        time.sleep(0.05)
    answer = post(server, "/abort_request", {"rid": rid}).json()
    assert answer["success"]
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 2000


def _abort_two_samples(server: Any, rid: str, prompt: str, in_flight_at_least: int
                       ) -> tuple[dict[str, Any], int, list[dict[str, Any]]]:
    """Send `prompt` with n = 2 under `rid`, abort `rid` once the server has that many
    requests in flight; (the abort's answer, requests in flight just before it, the outputs)."""
    answers: list[Any] = []

    def consume() -> None:
        answers.append(post(server, "/generate", {
            "text": prompt, "rid": rid, "sampling_params": {
                "n": 2, "max_new_tokens": 2000, "ignore_eos": True}}).json())

    thread = threading.Thread(target=consume)
    thread.start()
    in_flight = 0
    for _ in range(1000):
        in_flight = server.server_info()["num_in_flight_requests"]
        if in_flight >= in_flight_at_least:
            break
        time.sleep(0.02)
    answer = post(server, "/abort_request", {"rid": rid}).json()
    thread.join(timeout=120)
    assert not thread.is_alive()
    return answer, in_flight, answers[0]


def test_abort_request_route_aborts_every_sample_of_n(server: Any) -> None:
    # n > 1 runs as "<rid>-0" ... "<rid>-<n-1>": aborting "<rid>" aborts them all
    answer, _, outputs = _abort_two_samples(server, "abort-both-samples", PROMPT, 2)
    assert answer["success"] and answer["was_in_flight"]
    assert [out["meta_info"]["finish_reason"]["type"] for out in outputs] == ["abort", "abort"]


def test_abort_of_n_samples_while_their_prompt_is_cached_first(server: Any) -> None:
    """n > 1 first prefills the prompt once (an internal request) and sends the copies after
    it: an abort in that window used to find no copy and was lost (both ran to the end)."""
    # a prefill of seconds, not in the prefix cache from an earlier run against this server
    long_prompt = uuid.uuid4().hex + " " + " ".join(f"{PROMPT} ({i})" for i in range(60))
    answer, in_flight, outputs = _abort_two_samples(server, "abort-before-the-copies",
                                                    long_prompt, 1)
    assert in_flight == 1, "the copies were sent before the abort: the prompt was too short"
    assert answer["success"] and answer["was_in_flight"]
    assert [out["meta_info"]["finish_reason"]["type"] for out in outputs] == ["abort", "abort"]
    # sent, then aborted at once: at most a turn's tokens (both ran to 2000 before)
    assert all(out["meta_info"]["completion_tokens"] < 50 for out in outputs)


def test_control_routes(server: Any) -> None:
    info = requests.get(server.url("/get_model_info"), headers=server.headers, timeout=30).json()
    assert info["context_len"] > 0 and info["vocab_size"] == 49152
    assert requests.get(server.url("/health"), timeout=30).status_code == 200
    assert requests.get(server.url("/health_generate"), headers=server.headers,
                        timeout=120).status_code == 200
    state = server.wait_idle_memory_check()
    assert state["internal_state"]["memory_check_ok"] is True
    assert state["internal_state"]["leaked_tokens"] == 0
    flush = post(server, "/flush_cache", {})
    assert flush.status_code == 200 and flush.json()["success"]
    metrics = requests.get(server.url("/metrics"), headers=server.headers, timeout=30).text
    for name in ("radixserve:request_success_total", "radixserve:prompt_tokens_total",
                 "radixserve:generation_tokens_total",
                 "radixserve:time_to_first_token_seconds_bucket",
                 "radixserve:inter_token_latency_seconds_bucket",
                 "radixserve:e2e_request_latency_seconds_bucket",
                 "radixserve:num_running_reqs", "radixserve:num_queued_reqs",
                 "radixserve:token_usage", "radixserve:cache_hit_rate",
                 "radixserve:num_retractions_total", "radixserve:http_responses_total"):
        assert name in metrics, name
    finished = [line for line in metrics.splitlines()
                if line.startswith("radixserve:request_success_total")]
    assert sum(float(line.split()[-1]) for line in finished) >= 1


def _metric_sum(server: Any, name: str) -> float:
    text = requests.get(server.url("/metrics"), headers=server.headers, timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_parallel_samples_count_as_n_requests(server: Any) -> None:
    """n = 3 is three requests and three prompts in the metrics: the server's own prefill of
    the shared prompt (max_new_tokens 0, for the radix cache) is not one of them."""
    ids = list(range(100, 140))
    before = {name: _metric_sum(server, name) for name in (
        "radixserve:request_success_total", "radixserve:prompt_tokens_total",
        "radixserve:e2e_request_latency_seconds_count")}
    response = post(server, "/generate", {"input_ids": ids, "sampling_params": {
        "n": 3, "max_new_tokens": 2, "temperature": 0.7, "seed": 1}})
    assert response.status_code == 200 and len(response.json()) == 3
    after = {name: _metric_sum(server, name) for name in before}
    assert after["radixserve:request_success_total"] - \
        before["radixserve:request_success_total"] == 3
    assert after["radixserve:prompt_tokens_total"] - \
        before["radixserve:prompt_tokens_total"] == 3 * len(ids)
    assert after["radixserve:e2e_request_latency_seconds_count"] - \
        before["radixserve:e2e_request_latency_seconds_count"] == 3


def test_every_request_adds_one_first_token_time(server: Any) -> None:
    """A streamed request's first-token time is taken as its first token arrives; a
    non-streamed one's tokens reach the HTTP process at its end, so its time is the
    scheduler's first sample (it used to add its end-to-end latency, then nothing). Each adds
    one sample, no longer than the request took; the field stays out of meta_info."""
    count = "radixserve:time_to_first_token_seconds_count"
    total = "radixserve:time_to_first_token_seconds_sum"
    body = {"text": "Count to five:", "sampling_params": {"max_new_tokens": 24,
                                                          "ignore_eos": True}}
    before = (_metric_sum(server, count), _metric_sum(server, total))
    started = time.perf_counter()
    whole = post(server, "/generate", body)
    took = time.perf_counter() - started
    assert whole.status_code == 200 and "first_token_time" not in whole.json()["meta_info"]
    after = (_metric_sum(server, count), _metric_sum(server, total))
    assert after[0] == before[0] + 1
    assert 0 < after[1] - before[1] < took
    streamed = post(server, "/generate", {**body, "stream": True})
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    assert "first_token_time" not in streamed.text
    assert _metric_sum(server, count) == after[0] + 1


def _running_gauge(server: Any) -> float:
    return _metric_sum(server, "radixserve:num_running_reqs")


def test_metrics_answer_while_the_scheduler_is_busy(server: Any) -> None:
    """/metrics' gauges come from the states the scheduler sends unasked (every 0.5 s of work
    and on going idle): a scrape answers while the scheduler cannot (here: stopped), where it
    used to wait for the scheduler's turn to end (24 s behind a long unchunked prefill), and
    the gauges follow the work."""
    rid = "metrics-while-busy"
    thread = threading.Thread(target=lambda: post(server, "/generate", {
        "text": PROMPT, "rid": rid,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}))
    thread.start()
    scheduler_pid = server.server_info()["scheduler_pid"]
    try:
        deadline = time.monotonic() + 60
        while _running_gauge(server) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(scheduler_pid, signal.SIGSTOP)
        scrape = requests.get(server.url("/metrics"), headers=server.headers, timeout=10)
        assert scrape.status_code == 200
        assert _running_gauge(server) >= 1
    finally:
        os.kill(scheduler_pid, signal.SIGCONT)
        post(server, "/abort_request", {"rid": rid})
        thread.join(timeout=120)
    assert not thread.is_alive()
    deadline = time.monotonic() + 60
    while _running_gauge(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running_gauge(server) == 0  # the idle state went out when the work ended


def test_metrics_follow_a_cache_flush_while_idle(server: Any) -> None:
    """A flush on an idle server resets the cache hit rate: the scheduler sends its state
    again after the flush (the gauge kept the old rate until the next request)."""
    ids = list(range(300, 360))
    for _ in range(2):  # the second one hits the first one's prefix
        assert post(server, "/generate", {"input_ids": ids, "sampling_params": greedy(2)}
                    ).status_code == 200

    def hit_rate() -> float:
        return _metric_sum(server, "radixserve:cache_hit_rate")

    deadline = time.monotonic() + 30
    while hit_rate() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hit_rate() > 0
    server.wait_idle_memory_check()
    assert post(server, "/flush_cache", {}).json()["success"]
    deadline = time.monotonic() + 30
    while hit_rate() != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hit_rate() == 0
