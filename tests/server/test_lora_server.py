"""A real server with a LoRA adapter (--lora-paths) on a tiny Llama with the bundled tokenizer:
the openai client lists the adapter and picks it by `model`, /generate by `lora_path`; both give
the greedy tokens of transformers with the adapter merged, and the base model's stay its own;
unknown adapters are a 404 (OpenAI) and a 400 (native) naming them."""
from __future__ import annotations

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
                         "--lora-paths", f"tuned={root / 'adapter'}")
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
