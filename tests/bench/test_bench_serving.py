"""The serving client end to end against an in-test aiohttp server speaking the same protocols."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench_fake_server import FakeServer, FakeServerState
from bench_helpers import tiny_tokenizer
from radixserve.bench import serving
from radixserve.bench.datasets import (TokenSampler, sample_random_requests,
                                       sample_shared_prefix_requests)

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


def test_radixserve_stream_counts_match_what_was_sent(tmp_path: Path, tokenizer_dir: str) -> None:
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


def test_failed_warmup_stops_the_run(tmp_path: Path, tokenizer_dir: str) -> None:
    with FakeServer(FakeServerState(max_prompt_len=2)) as server:
        with pytest.raises(RuntimeError, match="warm-up"):
            _run(server, tmp_path / "w.jsonl", tokenizer_dir, "--num-prompts", "2",
                 "--random-input-len", "8", "--random-output-len", "3")
