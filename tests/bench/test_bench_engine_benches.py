"""`bench one-batch` and `bench offline` end to end on a tiny random-weight Llama (CPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig

from radixserve.bench import hardware, offline, one_batch
from radixserve.config import ServerArgs

engine_mod = pytest.importorskip("radixserve.engine")
runner_mod = pytest.importorskip("radixserve.executor.model_runner")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                architectures=["LlamaForCausalLM"], torch_dtype="float32").save_pretrained(path)
    return str(path)


def _server_kwargs(model: str) -> dict:
    return dict(model_path=model, load_format="dummy", dtype="float32", device="cpu",
                max_total_tokens=2048, random_seed=0)


def test_one_batch_matches_the_engine_and_frees_its_slots(tiny_model: str) -> None:
    runner = runner_mod.ModelRunner(ServerArgs(**_server_kwargs(tiny_model)))
    peak = hardware.DevicePeak("test", mem_bandwidth=1e10, peak_flops=1e13, source="flag")
    free_kv = runner.token_to_kv_pool.available_size()
    free_rows = runner.req_to_token_pool.available_size()
    batch, input_len, output_len = 3, 12, 6
    result = one_batch.run_one_batch(runner, batch, input_len, output_len, peak, seed=4)
    assert runner.token_to_kv_pool.available_size() == free_kv
    assert runner.req_to_token_pool.available_size() == free_rows
    assert result.output_ids_ok and len(result.output_ids) == batch
    # the overlap path (launch-ahead, ids read one step late) decodes the same tokens
    overlapped = one_batch.run_one_batch(runner, batch, input_len, output_len, peak, seed=4,
                                         overlap=True)
    assert overlapped.output_ids == result.output_ids and overlapped.output_ids_ok
    assert runner.token_to_kv_pool.available_size() == free_kv
    # prefilled in passes of two prompts and one: the same tokens, every slot freed
    in_passes = one_batch.run_one_batch(runner, batch, input_len, output_len, peak, seed=4,
                                        max_prefill_tokens=2 * input_len)
    assert in_passes.output_ids == result.output_ids
    assert runner.token_to_kv_pool.available_size() == free_kv
    assert result.prefill_tok_s * result.prefill_ms / 1e3 == pytest.approx(batch * input_len)
    assert result.decode_tok_s * result.decode_ms_per_step / 1e3 == pytest.approx(batch)
    assert result.prefill_ratio == pytest.approx(result.prefill_limit_ms / result.prefill_ms)
    assert result.decode_ratio == pytest.approx(result.decode_limit_ms / result.decode_ms_per_step)
    # a tiny fp32 model on these peaks is memory bound: the limit is bytes / bandwidth
    cfg = runner.model_config
    assert result.prefill_limit_ms == pytest.approx(
        hardware.prefill_bytes(cfg, batch, input_len, "float32") / 1e10 * 1e3)
    # the static batch decodes what the scheduler-driven Engine decodes (greedy, same weights)
    prompts = one_batch.make_prompts(batch, input_len, cfg.vocab_size, seed=4)
    engine = engine_mod.Engine(**_server_kwargs(tiny_model))
    outs = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True})
    engine.shutdown()
    assert [o["output_ids"] for o in outs] == result.output_ids


def test_prefill_passes_take_whole_requests_up_to_the_token_budget() -> None:
    reqs = one_batch._make_reqs(5, 10, 2, vocab_size=50, seed=0)
    sizes = [[len(r.origin_input_ids) for r in group]
             for group in one_batch.prefill_passes(reqs, 25)]
    assert sizes == [[10, 10], [10, 10], [10]]
    assert [len(g) for g in one_batch.prefill_passes(reqs, 7)] == [1] * 5  # one over budget each
    assert one_batch.prefill_passes(reqs, None) == [reqs]


def test_one_batch_cli_writes_json_lines(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "ob.jsonl"
    assert one_batch.main(["--model-path", tiny_model, "--load-format", "dummy", "--dtype",
                           "float32", "--batch-size", "1", "2", "--input-len", "8",
                           "--output-len", "3", "--bandwidth", "1e10", "--peak-flops", "1e11",
                           "--output-file", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch_size"] for r in records] == [1, 2]
    assert all(r["output_ids_ok"] and "output_ids" not in r for r in records)


def test_offline_radix_on_and_off(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "off.jsonl"
    groups, per_group, sys_len, q_len, out_len = 2, 3, 32, 4, 3
    assert offline.main(["--model-path", tiny_model, "--load-format", "dummy", "--dtype",
                         "float32", "--max-total-tokens", "2048",
                         # one request at a time, so later prompts find their group's prefix
                         "--max-running-requests", "1",
                         "--dataset-name", "generated-shared-prefix", "--gsp-num-groups",
                         str(groups), "--gsp-prompts-per-group", str(per_group),
                         "--gsp-system-prompt-len", str(sys_len), "--gsp-question-len",
                         str(q_len), "--gsp-output-len", str(out_len), "--radix", "both",
                         "--bandwidth", "1e10", "--peak-flops", "1e11",
                         "--sustained-peak-flops", "5e10", "--output-file", str(out)]) == 0
    on, off = [json.loads(line) for line in out.read_text().splitlines()]
    n = groups * per_group
    for rec in (on, off):
        assert rec["num_prompts"] == n and rec["output_len_mismatches"] == 0
        assert rec["total_input_tokens"] == n * (sys_len + q_len)
        assert rec["total_output_tokens"] == rec["expected_output_tokens"] == n * out_len
        assert rec["output_throughput"] * rec["duration_s"] == pytest.approx(n * out_len)
        assert rec["limit_ratio"] == pytest.approx(rec["limit_s"] / rec["duration_s"])
        assert 0 < rec["limit_s"] < rec["duration_s"]
        # at half the FLOP/s (the power limit's) the limit grows, the KV term unchanged
        assert rec["limit_s"] < rec["sustained_limit_s"] < 2 * rec["limit_s"]
        assert rec["sustained_limit_ratio"] == pytest.approx(
            rec["sustained_limit_s"] / rec["duration_s"])
        # one request at a time: its first token comes from the prefill, the rest one decode
        # step each (the warm-up request's steps are not counted)
        assert rec["decode_steps"] == n * (out_len - 1)
    assert (on["radix_cache"], off["radix_cache"]) == (True, False)
    assert on["cache_hit_rate"] > 0 and off["cache_hit_rate"] == 0


def _strict_json(line: str) -> dict:
    """json.loads that refuses NaN and infinities (which are not JSON)."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in a JSON line")
    return json.loads(line, parse_constant=refuse)


def _one_line_error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def _model_flags(model: str) -> list[str]:
    return ["--model-path", model, "--load-format", "dummy", "--dtype", "float32",
            "--max-total-tokens", "2048", "--bandwidth", "1e10", "--peak-flops", "1e11"]


@pytest.mark.parametrize("argv", [["--batch-size", "0"], ["--batch-size", "2", "-1"],
                                  ["--input-len", "0"], ["--output-len", "0"]])
def test_one_batch_rejects_empty_batches(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        one_batch.main(argv)
    assert exit_info.value.code == 2
    assert "error: argument " in _one_line_error(capsys)


@pytest.mark.parametrize("lengths,message", [
    (["--batch-size", "1", "--input-len", "500", "--output-len", "30"], "context length, 512"),
    (["--batch-size", "16", "--input-len", "128", "--output-len", "32"], "KV slots")])
def test_one_batch_says_when_a_batch_does_not_fit(tiny_model: str, lengths: list[str],
                                                  message: str,
                                                  capsys: pytest.CaptureFixture) -> None:
    assert one_batch.main([*_model_flags(tiny_model), *lengths]) == 1
    line = _one_line_error(capsys)
    assert line.startswith("error: ") and message in line


def test_one_batch_writes_json_without_nan(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "ob.jsonl"
    assert one_batch.main([*_model_flags(tiny_model), "--batch-size", "1", "--input-len", "8",
                           "--output-len", "1", "--output-file", str(out)]) == 0
    (record,) = [_strict_json(line) for line in out.read_text().splitlines()]
    assert record["decode_ms_per_step"] is None  # one token: no decode step was timed


def test_offline_without_requests_stops_before_loading(tiny_model: str,
                                                       capsys: pytest.CaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def no_engine(**kwargs: object) -> None:
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(engine_mod, "Engine", no_engine)
    assert offline.main([*_model_flags(tiny_model), "--num-prompts", "0"]) == 1
    assert _one_line_error(capsys) == "error: the workload flags ask for no requests"


def test_offline_says_when_outputs_exceed_the_context(tiny_model: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    assert offline.main([*_model_flags(tiny_model), "--radix", "on", "--num-prompts", "2",
                         "--random-input-len", "8", "--random-output-len", "9000"]) == 1
    line = _one_line_error(capsys)
    assert line.startswith("error: the engine refused the workload: ") and "512" in line


def test_offline_writes_unknown_limits_as_null(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "off.jsonl"
    assert offline.main([*_model_flags(tiny_model), "--radix", "on", "--num-prompts", "2",
                         "--random-input-len", "8", "--random-output-len", "3",
                         "--output-file", str(out)]) == 0
    (record,) = [_strict_json(line) for line in out.read_text().splitlines()]
    assert record["limit_s"] > 0  # no --sustained-peak-flops off an H200: no sustained limit
    assert record["sustained_limit_s"] is None and record["sustained_limit_ratio"] is None
