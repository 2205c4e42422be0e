"""A real server on a tiny Qwen2.5-VL checkpoint (tests/models/qwen_vl_folder.py) with the
openai client: images as data URLs through the chat route (streamed and not), their tokens at
the multimodal rope's 3-D positions, answer transformers' greedy tokens on the same pixels;
/tokenize counts each image's grid of pads as the chat route sends them (the image read and
processed); a bad image is a 400 naming it; nothing leaks (the idle memory check)."""
from __future__ import annotations

import base64
from typing import Any, Iterator

import openai
import pytest
import requests
from transformers import AutoTokenizer

from tests.models.llava_folder import noise_image, png_bytes
from tests.models.qwen_vl_folder import IMAGE_PAD, hf_greedy, write_qwen_vl_folder
from tests.server.server_process import ServerProcess

# 20 s (a server); Qwen-VL's images through the Engine: tests/models/test_qwen2_vl_serving.py, in CI
pytestmark = pytest.mark.slow

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("qwen_vl_server")
    hf_model = write_qwen_vl_folder(folder, "qwen2_5_vl")
    proc = ServerProcess("--model-path", str(folder), "--dtype", "float32",
                         "--chunked-prefill-size", "16", "--served-model-name", "model")
    yield {"proc": proc, "hf": hf_model, "tokenizer": AutoTokenizer.from_pretrained(str(folder))}
    assert proc.stop() == 0, proc.log_text()[-3000:]


def data_url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def messages(images: list[Any], text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(image)}}
                                   for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def expected_text(served: dict[str, Any], images: list[Any], text: str) -> str:
    tokenizer = served["tokenizer"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                      {"type": "text", "text": text}]}],
        tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return tokenizer.decode(hf_greedy(served["hf"], ids, images, NEW_TOKENS),
                            skip_special_tokens=True)


def test_chat_reads_images_at_their_rope_positions(served) -> None:
    images = [noise_image(61, (44, 30)), noise_image(62, (24, 40))]
    client = openai.OpenAI(base_url=served["proc"].url("/v1"), api_key="none", max_retries=0)
    want = expected_text(served, images, "w7 w8")
    answer = client.chat.completions.create(
        model="model", max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=messages(images, "w7 w8"))
    assert answer.choices[0].message.content == want
    stream = client.chat.completions.create(
        model="model", max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=messages(images[:1], "w9"), stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream
                   if chunk.choices) == expected_text(served, images[:1], "w9")


def test_tokenize_counts_each_images_grid(served) -> None:
    image = noise_image(63, (48, 40))  # 40 x 48 pixels: 10 x 12 patches, 5 x 6 tokens
    url = served["proc"].url("/tokenize")
    counted = requests.post(url, timeout=60, json={"messages": messages([image], "w7")}).json()
    assert counted["tokens"].count(IMAGE_PAD) == 30
    bad = requests.post(url, timeout=60, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert bad.status_code == 400 and "image 0" in bad.text, bad.text
