"""Process lifecycle of the real server: the bounded queue answers 429, a dead scheduler takes
the whole server down (non-zero, no orphans), a failing start-up reports the child's traceback,
shutdown ends open streams; and what the server's non-default flags change (one server carries
them all, since each start costs ~15 s on a 2-core CI machine)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
from typing import Iterator

import aiohttp
import pytest
import requests

from tests.server.native_client import PROMPT, greedy, post, sse_events
from tests.server.server_process import (REPO_ROOT, ServerProcess, free_port, pid_alive,
                                         wait_gone)


async def burst(server: ServerProcess, count: int) -> list[tuple[int, dict]]:
    """`count` completions at once, every fourth with n = 2 (its prompt prefilled first)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> tuple[int, dict]:
            async with session.post(server.url("/v1/completions"), json={
                    "prompt": f"Item {i}:", "max_tokens": 4, "temperature": 0,
                    "n": 2 if i % 4 == 0 else 1}) as response:
                return response.status, await response.json()
        return await asyncio.gather(*(one(i) for i in range(count)))


def test_queue_limit_then_scheduler_death() -> None:
    server = ServerProcess("--max-queued-requests", "2")
    try:
        results = asyncio.run(burst(server, 48))
        statuses = [status for status, _ in results]
        assert set(statuses) <= {200, 429}, statuses
        assert 429 in statuses and 200 in statuses
        for status, body in results:
            if status == 429:
                assert body["error"]["type"] == "rate_limit_error"
        # a refused request is no aborted one (an n = 2 whose prompt was refused counted 2)
        metrics = requests.get(server.url("/metrics"), timeout=30).text
        assert not [line for line in metrics.splitlines() if line.startswith(
            "radixserve:request_success_total") and 'finish_reason="abort"' in line
            and float(line.split()[-1]) > 0], metrics
        info = server.server_info()
        assert info["internal_state"]["num_queued_reqs"] == 0
        scheduler_pid, detokenizer_pid = info["scheduler_pid"], info["detokenizer_pid"]
        assert pid_alive(scheduler_pid) and pid_alive(detokenizer_pid)

        os.kill(scheduler_pid, signal.SIGKILL)
        code = server.proc.wait(timeout=60)  # hang guard
        assert code != 0
        assert wait_gone(detokenizer_pid), "the detokenizer outlived the server"
        assert "scheduler process died" in server.log_text()
    finally:
        server.stop()


@pytest.mark.slow  # the SIGTERM case below also checks a clean exit (0, no orphans)
def test_clean_sigint_shutdown() -> None:
    server = ServerProcess()
    try:
        info = server.server_info()
        assert requests.get(server.url("/health"), timeout=30).status_code == 200
        code = server.stop(signal.SIGINT)
        assert code == 0, server.log_text()[-3000:]
        assert wait_gone(info["scheduler_pid"]) and wait_gone(info["detokenizer_pid"])
    finally:
        server.stop()


def test_sigterm_to_the_whole_process_group_drains_the_requests() -> None:
    """systemd's stop (and `kill -- -PGID`) sends SIGTERM to every process of the server at
    once. The children ignore a SIGTERM that is not their parent's, so the server drains:
    a stream in flight runs to its end, the server exits 0 and stops its children itself (they
    used to die at once, and the request failed with "the detokenizer process died"). First,
    on the fresh server: its warm-up and /health_generate are not counted as requests; with a
    KV cache (400 tokens) shorter than the context, a request it cannot hold whole is a 400
    (it used to wait forever, holding up the requests behind it)."""
    server = ServerProcess("--shutdown-timeout", "120", "--max-total-tokens", "400",
                           own_process_group=True)
    try:
        info = server.server_info()
        too_long = post(server, "/generate", {"text": "Tell me a story.", "sampling_params": {
            "max_new_tokens": 600, "temperature": 0}})
        assert too_long.status_code == 400 and "KV cache holds" in too_long.text
        # a chat without max_tokens whose prompt leaves no room for an output token (399 of
        # the 399 a request reaches) got 200 and no content
        def chat_of(words: int) -> list[dict[str, str]]:
            return [{"role": "user", "content": "story " * words}]

        def count(words: int) -> int:
            return requests.post(server.url("/tokenize"), timeout=60, json={
                "messages": chat_of(words)}).json()["count"]

        words = 399 - count(0) - 8  # each word is one token, bar the template's joins
        while count(words) < 399:
            words += 1
        assert count(words) == 399
        no_room = requests.post(server.url("/v1/chat/completions"), timeout=60, json={
            "model": info["served_model_name"], "messages": chat_of(words)})
        assert no_room.status_code == 400 and "too long for the KV cache" in no_room.text, \
            no_room.text
        small = post(server, "/generate", {"text": "Hi", "sampling_params": greedy(3)})
        assert small.status_code == 200
        # the server's warm-up /generate and /health_generate are no requests of the metrics
        assert requests.get(server.url("/health_generate"), timeout=60).status_code == 200
        metrics = requests.get(server.url("/metrics"), timeout=30).text
        def counted(name: str) -> float:
            return sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith(name + "{"))
        # the small request above is the only one
        assert counted("radixserve:request_success_total") == 1
        assert counted("radixserve:prompt_tokens_total") == \
            small.json()["meta_info"]["prompt_tokens"]
        events: list[str] = []
        started = threading.Event()

        def read() -> None:
            with requests.post(server.url("/v1/completions"), stream=True, timeout=120, json={
                    "prompt": "Story:", "max_tokens": 24, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}) as response:
                for line in response.iter_lines(decode_unicode=True):
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        started.set()

        thread = threading.Thread(target=read)
        thread.start()
        assert started.wait(120)
        os.killpg(server.proc.pid, signal.SIGTERM)
        thread.join(timeout=120)
        assert server.proc.wait(timeout=120) == 0
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 24
        log = server.log_text()
        assert "ignoring SIGTERM from pid" in log and "died" not in log
        assert wait_gone(info["scheduler_pid"]) and wait_gone(info["detokenizer_pid"])
    finally:
        server.stop()


def _launch(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "radixserve.launch_server", *args],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # 10 s; a scheduler's start-up failure in one line: the checkpoint test
def test_startup_failure_reports_child_traceback() -> None:
    """A failure inside the scheduler process (here: a KV cache too small to serve, found once
    the model is loaded) is reported with the child's traceback."""
    result = _launch("--port", str(free_port()), "--max-total-tokens", "8")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "process failed to start" in output
    assert "Traceback" in output and "KV cache too small: 8 tokens" in output


@pytest.mark.slow  # 26 s (two servers that fail to start); the one-line start-up errors of a
# missing model and a busy port stay in CI below
def test_checkpoint_problems_are_one_line_each(tmp_path) -> None:
    """A model folder without tokenizer files fails before any child loads; a tensor the model
    has no place for fails in the scheduler: each one error line naming it, no traceback."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.loader.loader_test_utils import make_tiny_llama
    make_tiny_llama().save_pretrained(tmp_path)
    result = _launch("--port", str(free_port()), "--model-path", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output
    assert "has no tokenizer files; pass --tokenizer-path" in output
    assert "loading the model" not in output
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.bogus.weight"] = torch.ones(2)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    result = _launch("--port", str(free_port()), "--model-path", str(tmp_path),
                     "--skip-tokenizer-init", "--max-total-tokens", "2000")
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output, output[-3000:]
    assert "'model.layers.0.bogus.weight' has no place in LlamaForCausalLM" in output


@pytest.mark.slow  # 12 s; the flag check itself: tests/loader/test_int4_checkpoints.py
def test_a_quantization_flag_against_the_checkpoint_fails_before_loading(tmp_path) -> None:
    from tests.models.int4_checkpoints import write_int4_pair
    folder, _ = write_int4_pair(tmp_path, "awq")
    result = _launch("--port", str(free_port()), "--model-path", str(folder),
                     "--skip-tokenizer-init", "--quantization", "gptq")
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output, output[-3000:]
    assert "--quantization gptq does not match the checkpoint's awq quantization" in output
    assert "loading the model" not in output


def test_missing_model_and_busy_port_fail_before_loading() -> None:
    """Resolved in the server process before any child starts: one error line, no traceback."""
    result = _launch("--port", str(free_port()), "--model-path", "/nonexistent/model.gguf")
    output = result.stdout + result.stderr
    assert result.returncode == 1
    lines = [line for line in output.splitlines() if "/nonexistent/model.gguf" in line]
    assert len(lines) == 1 and "cannot serve the model" in lines[0]
    assert "Traceback" not in output
    assert "loading the model" not in output
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _launch("--port", str(port))
    output = result.stdout + result.stderr
    assert result.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in output
    assert "loading the model" not in output and "Traceback" not in output


def _open_streams(server: ServerProcess, count: int) -> tuple[list, list[list[str]]]:
    """`count` long streaming completions, each read in a thread into its list of events;
    returns once every stream has sent its first event."""
    import threading
    events: list[list[str]] = [[] for _ in range(count)]
    started = [threading.Event() for _ in range(count)]

    def read(i: int) -> None:
        with requests.post(server.url("/v1/completions"), stream=True, timeout=120, json={
                "prompt": f"Story {i}:", "max_tokens": 3000, "stream": True,
                "ignore_eos": True}) as response:
            for line in response.iter_lines(decode_unicode=True):
                if line.startswith("data: "):
                    events[i].append(line[len("data: "):])
                    started[i].set()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(120)
    return threads, events


# the two cases below run with --run-slow (25 s with their server); a SIGTERM's drain and
# clean exit: test_sigterm_to_the_whole_process_group_drains_the_requests, in CI
@pytest.fixture(scope="module")
def flagged_server() -> Iterator[ServerProcess]:
    """A server started with non-default flags; the shutdown test below ends it (last)."""
    server = ServerProcess("--shutdown-timeout", "1", "--incremental-streaming-output")
    yield server
    server.stop()


@pytest.mark.slow
def test_incremental_streaming_output_sends_only_new_pieces(
        flagged_server: ServerProcess) -> None:
    """--incremental-streaming-output: the chunks' texts and ids join into the whole output."""
    body = {"text": PROMPT, "sampling_params": greedy(12)}
    full = post(flagged_server, "/generate", body).json()
    events = sse_events(post(flagged_server, "/generate", {**body, "stream": True}, stream=True))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [i for c in chunks for i in c["output_ids"]] == full["output_ids"]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == len(full["output_ids"])


@pytest.mark.slow
def test_shutdown_ends_open_streams_with_an_error_event(flagged_server: ServerProcess) -> None:
    """SIGTERM with --shutdown-timeout 1: open streams end with an error event and [DONE]."""
    server = flagged_server
    try:
        threads, events = _open_streams(server, 3)
        server.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
        assert server.proc.wait(timeout=60) == 0
        for stream in events:
            assert stream[-1] == "[DONE]" and "shutting down" in stream[-2]
        log = server.log_text()
        assert "3 request(s) ended with an error" in log and "CancelledError" not in log
        # the drain actually waited for the timeout (the streams were long), and says so
        drained = re.search(r"after ([0-9.]+) s of drain \(at most 1\.0 s\)", log)
        assert drained is not None and 0.9 <= float(drained.group(1)) <= 2.0
    finally:
        server.stop()


@pytest.mark.slow  # scheduler death is also tested above (test_queue_limit_then_scheduler_death)
def test_open_streams_fail_at_once_when_the_scheduler_dies() -> None:
    server = ServerProcess()
    try:
        threads, events = _open_streams(server, 2)
        os.kill(server.server_info()["scheduler_pid"], signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive()
        for stream in events:
            assert stream[-1] == "[DONE]" and "the server failed" in stream[-2]
        assert server.proc.wait(timeout=60) != 0
    finally:
        server.stop()
