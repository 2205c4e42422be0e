"""A real server on an AWQ checkpoint (a tiny Llama with the bundled tokenizer): the openai
client's streamed and non-streamed completions agree, /generate's greedy tokens equal
transformers' on the dequantised twin, and the KV accounting is clean once idle."""
from __future__ import annotations

from typing import Any, Iterator

import openai
import pytest
import requests
import torch
import transformers

from tests.models.int4_checkpoints import write_int4_pair
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.server.server_process import ServerProcess


@pytest.fixture(scope="module")
def awq_server(tmp_path_factory) -> Iterator[tuple[ServerProcess, Any]]:
    from radixserve.loader.tokenizer import get_tokenizer

    root = tmp_path_factory.mktemp("awq")
    tokenizer = get_tokenizer(None)  # the bundled model's
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.08)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
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
