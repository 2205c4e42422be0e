"""A real server on an AWQ checkpoint (a tiny Llama with the bundled tokenizer): the openai
client's streamed and non-streamed completions agree, /generate's greedy tokens equal
transformers' on the dequantised twin, and the KV accounting is clean once idle."""
from __future__ import annotations

from typing import Any, Iterator

import openai
import pytest
import requests
import transformers

from tests.models.int4_checkpoints import write_int4_pair
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.server.bundled_tokenizer_models import save_tiny_model
from tests.server.server_process import ServerProcess

# 17 s (a server); int4 checkpoints through the Engine: tests/loader/test_int4_checkpoints.py, in CI
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def awq_server(tmp_path_factory) -> Iterator[tuple[ServerProcess, Any]]:
    root = tmp_path_factory.mktemp("awq")
    save_tiny_model(root / "base", transformers.LlamaConfig,
                    transformers.AutoModelForCausalLM, matrix_std=0.08,
                    tie_word_embeddings=False)
    folder, twin = write_int4_pair(root, "awq", base=root / "base")
    proc = ServerProcess("--model-path", str(folder), "--dtype", "float32")
    yield proc, transformers.AutoModelForCausalLM.from_pretrained(twin).eval()
    assert proc.stop() == 0, proc.log_text()[-3000:]


def test_awq_checkpoint_served_through_the_openai_client(awq_server) -> None:
    proc, twin = awq_server
    client = openai.OpenAI(base_url=proc.url("/v1"), api_key="none", max_retries=0)
    name = client.models.list().data[0].id
    whole = client.completions.create(model=name, prompt="The capital of France is",
                                      max_tokens=12, temperature=0)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=name, prompt="The capital of France is", max_tokens=12, temperature=0,
        stream=True) if chunk.choices)
    assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 12
    ids = requests.post(proc.url("/tokenize"), json={"prompt": "Once upon a time"},
                        timeout=30).json()["tokens"]
    out = requests.post(proc.url("/generate"), json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 10, "temperature": 0,
                                              "ignore_eos": True}}, timeout=60).json()
    assert out["output_ids"] == hf_greedy(twin, ids, 10)
    state = proc.wait_idle_memory_check()["internal_state"]
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0
