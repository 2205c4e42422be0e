"""The serving client end to end against an in-test aiohttp server speaking the same protocols."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench_fake_server import FakeServer, FakeServerState
from bench_helpers import WORDS, tiny_tokenizer
from radixserve.bench import serving
from radixserve.bench.backends import merge_body
from radixserve.bench.datasets import (SampleRequest, TokenSampler, sample_random_requests,
                                       sample_shared_prefix_requests)

REPO = Path(__file__).resolve().parents[2]

SEED = 5


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(str(path))
    return str(path)


def _run(server: FakeServer, out_file: Path, tokenizer_dir: str, *extra: str) -> list[dict]:
    argv = ["--base-url", server.base_url, "--tokenizer", tokenizer_dir, "--seed", str(SEED),
            "--output-file", str(out_file), "--output-details", "--disable-tqdm", *extra]
    assert serving.main(argv) == 0
    return [json.loads(line) for line in out_file.read_text().splitlines()]


def _check_consistent(record: dict[str, Any], num_prompts: int) -> None:
    details = record["details"]
    assert record["completed"] + record["failed"] == num_prompts == record["num_prompts"]
    ok = [i for i, err in enumerate(details["errors"]) if not err]
    assert len(ok) == record["completed"]
    for i in ok:
        assert 0 < details["ttfts"][i] <= details["latencies"][i]
    assert record["total_input_tokens"] == sum(details["prompt_lens"][i] for i in ok)
    assert record["total_output_tokens"] == sum(details["output_lens"][i] for i in ok)


def test_radixserve_stream_counts_match_what_was_sent(tmp_path: Path, tokenizer_dir: str,
                                                      capsys: pytest.CaptureFixture) -> None:
    num = 16
    tok = tiny_tokenizer()
    dataset = sample_random_requests(num, 16, 6, 0.5, SEED, TokenSampler(tok))
    refused_lens = sorted({r.prompt_len for r in dataset} - {dataset[0].prompt_len})[:2]
    state = FakeServerState(refuse_prompt_lens=set(refused_lens))
    with FakeServer(state) as server:
        (record,) = _run(server, tmp_path / "r.jsonl", tokenizer_dir, "--num-prompts", str(num),
                         "--random-input-len", "16", "--random-output-len", "6",
                         "--random-range-ratio", "0.5", "--max-concurrency", "4")
    _check_consistent(record, num)
    accepted = [r for r in dataset if r.prompt_len not in refused_lens]
    assert record["failed"] == num - len(accepted) > 0
    # some failures: the run still reports (exit 0), and says so below the table
    assert f"warning: {record['failed']} of {num} requests failed" in capsys.readouterr().out
    assert record["total_input_tokens"] == sum(r.prompt_len for r in accepted)
    assert record["total_output_tokens"] == sum(r.output_len for r in accepted)
    assert record["output_len_mismatches"] == 0
    # what reached the server: a warm-up, then exactly the dataset's prompts and lengths
    warmup, *bodies = state.bodies
    assert warmup["input_ids"] not in [r.prompt_ids for r in dataset]
    sent = Counter((tuple(b["input_ids"]), b["sampling_params"]["max_new_tokens"]) for b in bodies)
    assert sent == Counter((tuple(r.prompt_ids), r.output_len) for r in dataset)
    assert all(b["stream"] and b["sampling_params"]["ignore_eos"] for b in bodies)
    assert record["mean_itl_ms"] is not None and record["median_tpot_ms"] is not None


def test_random_ids_fit_the_served_vocabulary(tmp_path: Path, tokenizer_dir: str) -> None:
    state = FakeServerState(vocab_size=40)  # smaller than the tokenizer's 203 ids
    with FakeServer(state) as server:
        (record,) = _run(server, tmp_path / "v.jsonl", tokenizer_dir, "--num-prompts", "4",
                         "--random-input-len", "50", "--random-output-len", "2")
    assert record["completed"] == 4
    ids = {t for body in state.bodies for t in body["input_ids"]}
    assert ids <= set(range(3, 40)) and len(ids) > 20  # in the vocabulary, no special ids


def test_error_event_mid_stream_fails_the_request(tmp_path: Path, tokenizer_dir: str) -> None:
    num = 10
    dataset = sample_random_requests(num, 12, 4, 0.5, SEED, TokenSampler(tiny_tokenizer()))
    broken = {r.prompt_len for r in dataset[1:]} - {dataset[0].prompt_len}
    broken = {min(broken)}
    state = FakeServerState(midstream_error_prompt_lens=broken)
    with FakeServer(state) as server:
        (record,) = _run(server, tmp_path / "e.jsonl", tokenizer_dir, "--num-prompts", str(num),
                         "--random-input-len", "12", "--random-output-len", "4",
                         "--random-range-ratio", "0.5")
    _check_consistent(record, num)
    assert record["failed"] == sum(r.prompt_len in broken for r in dataset) > 0
    assert any("scheduler died" in e for e in record["errors"])


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_openai_backends(tmp_path: Path, tokenizer_dir: str, backend: str) -> None:
    state = FakeServerState()
    with FakeServer(state) as server:
        (record,) = _run(server, tmp_path / "o.jsonl", tokenizer_dir, "--backend", backend,
                         "--num-prompts", "6", "--random-input-len", "12",
                         "--random-output-len", "5", "--random-range-ratio", "0.5",
                         "--request-rate", "200")
    _check_consistent(record, 6)
    assert record["failed"] == 0 and record["output_len_mismatches"] == 0
    assert record["model"] == "fake-model"
    dataset = sample_random_requests(6, 12, 5, 0.5, SEED, TokenSampler(tiny_tokenizer()))
    assert record["total_input_tokens"] == sum(r.prompt_len for r in dataset)
    assert record["total_output_tokens"] == sum(r.output_len for r in dataset)
    for body in state.bodies:
        assert body["model"] == "fake-model" and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}
    if backend == "openai":
        assert sorted(b["prompt"] for b in state.bodies[1:]) == \
            sorted(r.prompt_ids for r in dataset)


@pytest.mark.parametrize("backend", ["radixserve", "openai-chat"])
def test_lora_names_go_to_the_requests_in_turn(tmp_path: Path, tokenizer_dir: str,
                                               backend: str) -> None:
    """--lora-name a b: the requests name a, b, a, ... (radixserve's lora_path, OpenAI's
    model); the warm-up names none."""
    state = FakeServerState()
    with FakeServer(state) as server:
        (record,) = _run(server, tmp_path / "l.jsonl", tokenizer_dir, "--backend", backend,
                         "--num-prompts", "4", "--random-input-len", "8",
                         "--random-output-len", "3", "--lora-name", "a", "b",
                         "--max-concurrency", "1")
    assert record["completed"] == 4 and record["lora_names"] == ["a", "b"]
    key = "lora_path" if backend == "radixserve" else "model"
    warm_up, *sent = state.bodies
    assert [body[key] for body in sent] == ["a", "b", "a", "b"]
    assert warm_up.get(key) in (None, "fake-model")


def test_disable_stream(tmp_path: Path, tokenizer_dir: str) -> None:
    with FakeServer() as server:
        (record,) = _run(server, tmp_path / "n.jsonl", tokenizer_dir, "--disable-stream",
                         "--num-prompts", "4", "--random-input-len", "8",
                         "--random-output-len", "3")
    assert record["completed"] == 4 and record["total_output_tokens"] == 12
    assert record["mean_ttft_ms"] is None and record["mean_e2e_latency_ms"] > 0


def test_short_outputs_are_reported_as_mismatches(tmp_path: Path, tokenizer_dir: str) -> None:
    """A server that stops at EOS (ignore_eos turned off here) is caught, not averaged in."""
    with FakeServer(FakeServerState(eos_after=2)) as server:
        (record,) = _run(server, tmp_path / "m.jsonl", tokenizer_dir, "--backend", "openai",
                         "--num-prompts", "5", "--random-input-len", "8",
                         "--random-output-len", "6", "--extra-request-body",
                         '{"ignore_eos": false}')
    assert record["completed"] == 5 and record["output_len_mismatches"] == 5
    assert record["total_output_tokens"] == 10


def test_shared_prefix_reports_cache_hits(tmp_path: Path, tokenizer_dir: str) -> None:
    groups, per_group, sys_len, q_len = 2, 3, 40, 4
    state = FakeServerState()
    with FakeServer(state) as server:
        (record,) = _run(server, tmp_path / "s.jsonl", tokenizer_dir,
                         "--dataset-name", "generated-shared-prefix", "--gsp-num-groups",
                         str(groups), "--gsp-prompts-per-group", str(per_group),
                         "--gsp-system-prompt-len", str(sys_len), "--gsp-question-len",
                         str(q_len), "--gsp-output-len", "3", "--max-concurrency", "1",
                         "--flush-cache")
    _check_consistent(record, groups * per_group)
    # in order, every prompt after the first of its group reuses at least the system prompt
    least = groups * (per_group - 1) * sys_len / (groups * per_group * (sys_len + q_len))
    assert record["cache_hit_rate"] >= least
    assert record["server_cache_hit_rate"] > 0
    dataset = sample_shared_prefix_requests(groups, per_group, sys_len, q_len, 3, SEED,
                                            token_sampler=TokenSampler(tiny_tokenizer()))
    assert [b["input_ids"] for b in state.bodies[1:]] == [r.prompt_ids for r in dataset]


def test_rate_sweep_appends_one_line_per_rate(tmp_path: Path, tokenizer_dir: str) -> None:
    with FakeServer() as server:
        records = _run(server, tmp_path / "sweep.jsonl", tokenizer_dir, "--num-prompts", "4",
                       "--random-input-len", "8", "--random-output-len", "3",
                       "--request-rate-range", "100,inf", "--label", "fake")
    assert [r["request_rate"] for r in records] == [100.0, None]
    assert [r["seed"] for r in records] == [SEED, SEED + 1]
    assert all(r["label"] == "fake" and r["completed"] == 4 for r in records)


def _main_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """Run serving.main, which must fail with exit status 1 and one line on stderr."""
    assert serving.main(["--disable-tqdm", *argv]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ")
    return last


def test_failed_warmup_stops_the_run(tmp_path: Path, tokenizer_dir: str,
                                     capsys: pytest.CaptureFixture) -> None:
    with FakeServer(FakeServerState(max_prompt_len=2)) as server:
        line = _main_error(capsys, "--base-url", server.base_url, "--tokenizer", tokenizer_dir,
                           "--num-prompts", "2", "--random-input-len", "8",
                           "--random-output-len", "3")
    assert line.startswith("error: warm-up request failed: HTTP 400")


def _write_sharegpt(path: Path, prompts: list[str]) -> None:
    reply = " ".join(WORDS[100:106])
    path.write_text("\n".join(json.dumps({"conversations": [
        {"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]})
        for prompt in prompts) + "\n")


def test_warmup_of_text_prompts_caches_nothing_the_run_uses(tmp_path: Path,
                                                            tokenizer_dir: str) -> None:
    """ShareGPT prompts are text: the warm-up must not be the first of them again."""
    prompts = [" ".join(WORDS[10 * i:10 * i + 6]) for i in range(5)]  # no shared prefix
    _write_sharegpt(tmp_path / "conv.jsonl", prompts)
    state = FakeServerState()
    with FakeServer(state) as server:
        (record,) = _run(server, tmp_path / "t.jsonl", tokenizer_dir, "--dataset-name",
                         "sharegpt", "--dataset-path", str(tmp_path / "conv.jsonl"),
                         "--num-prompts", "5", "--sharegpt-output-len", "3",
                         "--max-concurrency", "1")
    assert record["completed"] == 5 and record["cache_hit_rate"] == 0.0
    warmup = state.bodies[0]["text"].split()
    assert len(warmup) == 6 and warmup[0] not in {p.split()[0] for p in prompts}


@pytest.mark.parametrize("text", ["w1 w2 w1", "w7"])
def test_warmup_text_gets_a_marker_when_reversing_changes_nothing(text: str) -> None:
    requests = [SampleRequest(prompt_len=3, output_len=4, prompt_text=text),
                SampleRequest(prompt_len=2, output_len=4, prompt_text="w9 w8")]
    warm = serving.make_warmup(requests, None, seed=0)
    assert warm.prompt_text == " ".join([serving.WARMUP_MARKER, *text.split()[::-1]])
    assert warm.prompt_ids is None and warm.output_len == 4


def test_extra_body_is_merged_key_by_key() -> None:
    body = {"sampling_params": {"max_new_tokens": 8, "ignore_eos": True,
                                "nested": {"a": 1, "b": 2}}, "stream": True}
    extra = {"sampling_params": {"top_k": 1, "nested": {"b": 3}}, "stream": False,
             "text": {"replaces": "a string"}}
    assert merge_body(body, extra) == {
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "top_k": 1,
                            "nested": {"a": 1, "b": 3}},
        "stream": False, "text": {"replaces": "a string"}}
    assert body["sampling_params"]["nested"] == {"a": 1, "b": 2}  # the input is left alone


def test_extra_sampling_params_keep_the_requested_length(tmp_path: Path,
                                                         tokenizer_dir: str) -> None:
    state = FakeServerState()
    with FakeServer(state) as server:
        (record,) = _run(server, tmp_path / "x.jsonl", tokenizer_dir, "--num-prompts", "3",
                         "--random-input-len", "8", "--random-output-len", "5",
                         "--extra-request-body", '{"sampling_params": {"top_k": 1}}')
    assert record["completed"] == 3 and record["output_len_mismatches"] == 0
    assert record["total_output_tokens"] == 15
    for body in state.bodies[1:]:
        assert body["sampling_params"] == {"max_new_tokens": 5, "ignore_eos": True,
                                           "temperature": 0.0, "top_k": 1}


@pytest.mark.parametrize("backend", ["radixserve", "openai"])
def test_api_key_goes_with_every_request(tmp_path: Path, tokenizer_dir: str,
                                         backend: str) -> None:
    state = FakeServerState(api_key="secret", vocab_size=40)
    with FakeServer(state) as server:
        (record,) = _run(server, tmp_path / "k.jsonl", tokenizer_dir, "--backend", backend,
                         "--api-key", "secret", "--flush-cache", "--num-prompts", "3",
                         "--random-input-len", "50", "--random-output-len", "2")
    assert record["completed"] == 3
    assert state.flushes == 1 and record["server_cache_hit_rate"] is not None
    if backend == "openai":
        assert record["model"] == "fake-model"
    else:  # /get_model_info answered: the ids fit its vocabulary
        assert {t for body in state.bodies for t in body["input_ids"]} <= set(range(3, 40))


def test_a_run_without_one_success_exits_1(tokenizer_dir: str,
                                           capsys: pytest.CaptureFixture) -> None:
    with FakeServer(FakeServerState(max_prompt_len=2)) as server:
        line = _main_error(capsys, "--base-url", server.base_url, "--tokenizer", tokenizer_dir,
                           "--disable-warmup", "--num-prompts", "3", "--random-input-len", "8",
                           "--random-output-len", "3")
    assert line.startswith("error: all 3 requests failed (first error: HTTP 400")


def _unreachable_url() -> str:
    server = FakeServer()  # never started: nothing listens on its port
    return server.base_url


def test_an_unreachable_server_is_an_error(tokenizer_dir: str,
                                           capsys: pytest.CaptureFixture) -> None:
    base = ["--base-url", _unreachable_url(), "--tokenizer", tokenizer_dir, "--num-prompts", "2",
            "--random-input-len", "8", "--random-output-len", "3"]
    assert _main_error(capsys, *base, "--disable-warmup").startswith(
        "error: all 2 requests failed")
    assert _main_error(capsys, *base, "--flush-cache").startswith("error: --flush-cache: ")


@pytest.mark.parametrize("argv", [
    ["--num-prompts", "-1"], ["--random-input-len", "0"], ["--random-output-len", "0"],
    ["--random-range-ratio", "1.5"], ["--random-range-ratio", "-0.1"], ["--request-rate", "0"],
    ["--request-rate", "-2"], ["--request-rate-range", "1,0"], ["--request-rate-range", "1,x"],
    ["--max-concurrency", "0"], ["--sharegpt-output-len", "0"],
    ["--dataset-path", "/nonexistent/conv.json"], ["--extra-request-body", "{bad"],
    ["--extra-request-body", "[1]"], ["--output-file", "/nonexistent-dir/runs.jsonl"]],
    ids=lambda argv: " ".join(argv))
def test_bad_arguments_are_one_line_errors(argv: list[str],
                                           capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        serving.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"radixserve bench serving: error: argument {argv[0]}: ")


def test_a_malformed_dataset_file_is_an_error(tmp_path: Path, tokenizer_dir: str,
                                              capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "conv.jsonl"
    _write_sharegpt(path, ["w1 w2 w3 w4"])
    path.write_text(path.read_text() + "{not json\n")
    line = _main_error(capsys, "--backend", "openai", "--base-url", _unreachable_url(),
                       "--tokenizer", tokenizer_dir, "--dataset-name", "sharegpt",
                       "--dataset-path", str(path))
    assert line == f"error: {path} line 2: not valid JSON"


@pytest.mark.parametrize("backend", ["radixserve", "openai", "openai-chat"])
def test_a_stream_that_ends_early_fails_the_request(tmp_path: Path, tokenizer_dir: str,
                                                    backend: str) -> None:
    num = 10
    dataset = sample_random_requests(num, 12, 4, 0.5, SEED, TokenSampler(tiny_tokenizer()))
    cut = {min({r.prompt_len for r in dataset} - {dataset[0].prompt_len})}
    with FakeServer(FakeServerState(cut_stream_prompt_lens=cut)) as server:
        (record,) = _run(server, tmp_path / "c.jsonl", tokenizer_dir, "--backend", backend,
                         "--num-prompts", str(num), "--random-input-len", "12",
                         "--random-output-len", "4", "--random-range-ratio", "0.5")
    _check_consistent(record, num)
    assert record["failed"] == sum(r.prompt_len in cut for r in dataset) > 0
    assert record["output_len_mismatches"] == 0
    assert all("ended early" in e for e in record["errors"])


def test_ctrl_c_ends_the_run_with_one_line(tokenizer_dir: str) -> None:
    state = FakeServerState(token_delay_s=0.2)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with FakeServer(state) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.bench.serving", "--base-url", server.base_url,
             "--tokenizer", tokenizer_dir, "--num-prompts", "100", "--random-input-len", "8",
             "--random-output-len", "3", "--max-concurrency", "1", "--disable-tqdm"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            # a shell's background job (nohup ... &, as CI may run us) ignores SIGINT, and a
            # Python started so never raises KeyboardInterrupt: give the run the default back
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 60
            while len(state.bodies) < 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)  # until the run (after the warm-up) is under way
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted"
