"""A real server with --is-embedding (a tiny Qwen3Model with the bundled tokenizer) through the
openai client: /v1/embeddings in base64 (the SDK's default) and float, `dimensions`, SGLang's
/encode, the vectors against transformers; generation refused there, embeddings refused by a
generation server, with 400s."""
from __future__ import annotations

from typing import Any, Iterator

import openai
import pytest
import requests
import torch
import transformers

from tests.server.bundled_tokenizer_models import save_tiny_model
from tests.server.server_process import ServerProcess


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory) -> Iterator[tuple[ServerProcess, Any]]:
    folder = tmp_path_factory.mktemp("qwen3_embedding")
    # headless, as Qwen3-Embedding's
    model = save_tiny_model(folder, transformers.Qwen3Config, transformers.AutoModel,
                            head_dim=16)
    proc = ServerProcess("--model-path", str(folder), "--is-embedding", "--dtype", "float32")
    yield proc, model
    assert proc.stop() == 0, proc.log_text()[-3000:]


def _reference(model: Any, ids: list[int]) -> list[float]:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1).tolist()


def test_embeddings_through_the_openai_client(embedding_server) -> None:
    proc, model = embedding_server
    client = openai.OpenAI(base_url=proc.url("/v1"), api_key="none", max_retries=0)
    name = client.models.list().data[0].id
    texts = ["Hello world", "The capital of France is Paris."]
    ids = [requests.post(proc.url("/tokenize"), json={"prompt": t}, timeout=30).json()["tokens"]
           for t in texts]
    got = client.embeddings.create(model=name, input=texts)  # base64 under the hood
    assert [d.index for d in got.data] == [0, 1]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    for item, token_ids in zip(got.data, ids):
        assert item.embedding == pytest.approx(_reference(model, token_ids), abs=2e-5)
    floats = client.embeddings.create(model=name, input=ids[0], encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(got.data[0].embedding, abs=1e-6)
    cut = client.embeddings.create(model=name, input=texts[0], dimensions=16,
                                   encoding_format="float").data[0].embedding
    head = torch.tensor(got.data[0].embedding[:16])
    assert cut == pytest.approx((head / head.norm()).tolist(), abs=1e-5)
    encoded = requests.post(proc.url("/encode"), json={"text": texts[1]}, timeout=60).json()
    assert encoded["embedding"] == pytest.approx(got.data[1].embedding, abs=1e-6)
    assert encoded["meta_info"]["prompt_tokens"] == len(ids[1])


def test_bad_requests_get_400s(embedding_server, server) -> None:
    proc, _ = embedding_server
    for path, body in (("/v1/embeddings", {"input": []}),
                       ("/v1/embeddings", {"input": "x", "dimensions": 0}),
                       ("/v1/embeddings", {"input": "x", "dimensions": 65}),
                       ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}),
                       ("/v1/embeddings", {"input": "x", "dimensions": True}),
                       ("/encode", {"text": 5}),
                       ("/encode", {"text": [1, 2, 3]}),
                       ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 0}}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True,
                                            "logprobs": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "x"}]})):
        reply = requests.post(proc.url(path), json=body, timeout=60)
        assert reply.status_code == 400, (path, body, reply.text)
        assert reply.json()["error"]["message"]
    assert requests.get(proc.url("/health_generate"), timeout=60).status_code == 200
    assert requests.get(proc.url("/get_model_info"), timeout=60).json()["is_generation"] is False
    reply = requests.post(server.url("/v1/embeddings"), json={"input": "x"},
                          headers=server.headers, timeout=60)
    assert reply.status_code == 400 and "--is-embedding" in reply.json()["error"]["message"]
    assert proc.wait_idle_memory_check()["internal_state"]["memory_check_ok"]
