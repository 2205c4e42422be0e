"""A real server with a LoRA adapter (--lora-paths) on a tiny Llama with the bundled tokenizer:
the openai client lists the adapter and picks it by `model`, /generate by `lora_path`; both give
the greedy tokens of transformers with the adapter merged, and the base model's stay its own;
unknown adapters are a 404 (OpenAI) and a 400 (native) naming them. A second adapter is loaded
into the spare slot (--max-loras 2) and unloaded again over HTTP while the server runs."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
import requests
import transformers

from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.test_lora import ALL_MODULES, merged, write_adapter
from tests.server.bundled_tokenizer_models import save_tiny_model
from tests.server.server_process import ServerProcess

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory) -> Iterator[tuple[ServerProcess, Any, Any]]:
    root = tmp_path_factory.mktemp("lora_server")
    base = save_tiny_model(root / "base", transformers.LlamaConfig,
                           transformers.AutoModelForCausalLM, matrix_std=0.08,
                           tie_word_embeddings=False).eval()
    pairs = write_adapter(root / "adapter", base, ALL_MODULES, rank=4, alpha=16.0, seed=7)
    proc = ServerProcess("--model-path", str(root / "base"), "--dtype", "float32",
                         "--lora-paths", f"tuned={root / 'adapter'}", "--max-loras", "2")
    proc.root = root
    yield proc, base, merged(base, pairs, 16.0 / 4).eval()
    assert proc.stop() == 0, proc.log_text()[-3000:]


def test_the_adapter_is_listed_and_served_by_both_apis(lora_server) -> None:
    proc, base, tuned = lora_server
    client = openai.OpenAI(base_url=proc.url("/v1"), api_key="none", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    base_name = next(name for name in models if name != "tuned")
    assert models["tuned"].model_dump()["parent"] == base_name
    assert client.models.retrieve("tuned").model_dump()["parent"] == base_name
    ids = requests.post(proc.url("/tokenize"), json={"prompt": "Once upon a time"},
                        timeout=30).json()["tokens"]
    out = {}
    for name in ("tuned", None):
        body = {"input_ids": ids, "sampling_params": GREEDY, "lora_path": name}
        out[name] = requests.post(proc.url("/generate"), json=body, timeout=60).json()
    assert out["tuned"]["output_ids"] == hf_greedy(tuned, ids, 8)
    assert out[None]["output_ids"] == hf_greedy(base, ids, 8)
    assert out["tuned"]["output_ids"] != out[None]["output_ids"]
    completion = client.completions.create(model="tuned", prompt=ids, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.model == "tuned" and completion.choices[0].text == out["tuned"]["text"]
    chat = client.chat.completions.create(model="tuned", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == "tuned" and chat.usage.completion_tokens >= 1
    state = proc.wait_idle_memory_check()["internal_state"]
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0


def test_sglangs_lora_path_names_the_adapter_on_the_openai_routes(lora_server) -> None:
    """lora_path (extra body) with the base model's name serves the adapter as `model` does;
    a lora_path naming another adapter than `model`, or none loaded, is a 400."""
    proc, _, _ = lora_server
    client = openai.OpenAI(base_url=proc.url("/v1"), api_key="none", max_retries=0)
    base_name = next(m.id for m in client.models.list().data if m.id != "tuned")
    args = dict(prompt=list(range(20, 30)), max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})
    by_model = client.completions.create(model="tuned", **args).choices[0].text
    by_field = client.completions.create(model=base_name, **{
        **args, "extra_body": {"ignore_eos": True, "lora_path": "tuned"}})
    assert by_field.choices[0].text == by_model and by_field.model == base_name
    for model, lora_path, message in (("tuned", "other", "give one"),
                                      (base_name, "nope", "unknown LoRA adapter 'nope'")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model=model, max_tokens=2, messages=[
                {"role": "user", "content": "Hi"}], extra_body={"lora_path": lora_path})


def test_unknown_adapters_are_refused_by_name(lora_server) -> None:
    proc, _, _ = lora_server
    client = openai.OpenAI(base_url=proc.url("/v1"), api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    reply = requests.post(proc.url("/generate"), json={
        "text": "Hi", "sampling_params": GREEDY, "lora_path": "nope"}, timeout=30)
    assert reply.status_code == 400 and "unknown LoRA adapter 'nope'" in reply.text


def test_prompt_warm_ups_are_per_adapter() -> None:
    """n > 1 (or a batch repeating a prompt) prefills each repeated prompt once first; copies on
    different adapters share no KV, so only a prompt repeated on the same adapter warms up."""
    from radixserve.core.sampling_params import SamplingParams
    from radixserve.server.request_state import GenerateRequest
    from radixserve.server.shared_prefix import WaitingCopies, plan_warmups

    def req(rid: str, lora: str | None) -> GenerateRequest:
        return GenerateRequest(rid, [5, 6, 7], None, SamplingParams(), lora_name=lora)

    reqs = [req("a1", "a"), req("b1", "b"), req("a2", "a"), req("base", None)]
    warmups = plan_warmups(reqs)
    assert [w.lora_name for w in warmups.values()] == ["a"]
    waiting = WaitingCopies()
    waiting.wait(reqs, warmups)
    assert "a1" in waiting and "a2" in waiting and "b1" in waiting
    warm_rid = next(iter(warmups.values())).rid
    assert waiting._warmup_of == {"a1": warm_rid, "b1": None, "a2": warm_rid, "base": None}
    # an unload of "a" waits while a copy of it waits to be sent
    assert waiting.uses_adapter("a") and waiting.uses_adapter("b")
    waiting.sent("a1")
    waiting.forget([reqs[2]])
    assert not waiting.uses_adapter("a") and waiting.uses_adapter("b")


def test_metrics_count_each_adapters_requests(lora_server) -> None:
    proc, _, _ = lora_server
    requests.post(proc.url("/generate"), json={"text": "Hi", "sampling_params": GREEDY,
                                               "lora_path": "tuned"}, timeout=60).raise_for_status()
    text = requests.get(proc.url("/metrics"), timeout=30).text
    lines = [line for line in text.splitlines()
             if line.startswith("radixserve:lora_requests_total{") and 'lora_name="tuned"' in line]
    assert lines and float(lines[0].rsplit(" ", 1)[1]) >= 1, text[-2000:]
    tokens = [line for line in text.splitlines() if line.startswith(
        "radixserve:lora_generation_tokens_total{") and 'lora_name="tuned"' in line]
    assert tokens and float(tokens[0].rsplit(" ", 1)[1]) >= 8


def _post(proc: ServerProcess, path: str, body: dict) -> requests.Response:
    return requests.post(proc.url(path), json=body, timeout=60)


def test_an_adapter_loads_and_unloads_while_serving(lora_server) -> None:
    """POST /load_lora_adapter puts a second adapter in the spare slot: /v1/models lists it and
    it serves its merged model's tokens; a full set of slots, a taken name and a folder
    without an adapter are refused with the reason; /v1/unload_lora_adapter waits for the
    adapter's stream in flight to finish, then its requests are refused and a second unload
    is a 404."""
    proc, base, _ = lora_server
    root: Path = proc.root
    pairs = write_adapter(root / "second", base, ("q_proj", "v_proj", "down_proj"), rank=2,
                          alpha=4.0, seed=9)
    reply = _post(proc, "/load_lora_adapter", {"lora_name": "second",
                                               "lora_path": str(root / "second")})
    assert reply.status_code == 200 and reply.json()["loaded_adapters"] == ["tuned", "second"]
    client = openai.OpenAI(base_url=proc.url("/v1"), api_key="none", max_retries=0)
    assert "second" in {m.id for m in client.models.list().data}
    for body, reason in (({"lora_name": "third", "lora_path": str(root / "second")},
                          "slots are taken"),
                         ({"lora_name": "second", "lora_path": str(root / "second")},
                          "loaded already"),
                         ({"lora_name": "x"}, "'lora_path'")):
        refused = _post(proc, "/v1/load_lora_adapter", body)
        assert refused.status_code == 400 and reason in refused.text, refused.text
    ids = list(range(20, 36))
    out = _post(proc, "/generate", {"input_ids": ids, "sampling_params": GREEDY,
                                    "lora_path": "second"}).json()
    assert out["output_ids"] == hf_greedy(merged(base, pairs, 2.0).eval(), ids, 8)

    streamed: dict[str, Any] = {}
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"input_ids": ids, "stream": True, "lora_path": "second",
                "sampling_params": {**GREEDY, "max_new_tokens": 400}}
        with requests.post(proc.url("/generate"), json=body, stream=True, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                first_chunk.set()
                lines.append(line)
        streamed["at"] = time.monotonic()
        streamed["last"] = json.loads([x for x in lines if x][-2].removeprefix(b"data: "))

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert first_chunk.wait(timeout=60)
    asked_at = time.monotonic()  # the stream is open: its request runs on the adapter
    reply = _post(proc, "/v1/unload_lora_adapter", {"lora_name": "second"})
    streamer.join(timeout=120)
    assert reply.status_code == 200 and reply.json()["loaded_adapters"] == ["tuned"]
    # the unload was asked while the stream ran (else this tests nothing), and it waited:
    # the scheduler refuses (409) to unload an adapter with requests, so a 200 means the
    # front end drained them first; and the stream ran to its length, not cut or failed
    assert asked_at < streamed["at"], "the stream ended before the unload was asked"
    assert streamed["last"]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(streamed["last"]["output_ids"]) == 400
    refused = _post(proc, "/generate", {"input_ids": ids, "sampling_params": GREEDY,
                                        "lora_path": "second"})
    assert refused.status_code == 400 and "unknown LoRA adapter 'second'" in refused.text
    assert _post(proc, "/unload_lora_adapter", {"lora_name": "second"}).status_code == 404
    state = proc.wait_idle_memory_check()["internal_state"]
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
