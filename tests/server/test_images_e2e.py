"""A real server on a tiny LLaVA checkpoint (tests/models/llava_folder.py) with the openai
client: images as data URLs, http URLs (a local file server) and files in
--allowed-local-media-path reach the model through the chat route, the Responses route and
/generate's image_data, each answering transformers' greedy tokens on the same pixels; bad
images are 400s naming the image; nothing leaks (the idle memory check)."""
from __future__ import annotations

import base64
import functools
import http.server
import threading
from typing import Any, Iterator

import openai
import pytest
import requests
from transformers import AutoTokenizer

from tests.models.llava_folder import (expanded, hf_greedy_with_images, noise_image,
                                       png_bytes, write_llava_folder)
from tests.server.server_process import ServerProcess

NEW_TOKENS = 5
TOKENS_PER_IMAGE = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("llava_server")
    folder, media = root / "model", root / "media"
    media.mkdir()
    hf_model = write_llava_folder(folder)
    images = [noise_image(seed) for seed in (31, 32)]
    for i, image in enumerate(images):
        (media / f"{i}.png").write_bytes(png_bytes(image))
    files = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(http.server.SimpleHTTPRequestHandler,
                                            directory=str(media)))
    threading.Thread(target=files.serve_forever, daemon=True).start()
    proc = ServerProcess("--model-path", str(folder), "--dtype", "float32",
                         "--chunked-prefill-size", "24", "--allowed-local-media-path",
                         str(media))
    yield {"proc": proc, "hf": hf_model, "folder": folder, "images": images, "media": media,
           "files_url": f"http://127.0.0.1:{files.server_address[1]}",
           "tokenizer": AutoTokenizer.from_pretrained(str(folder))}
    files.shutdown()
    assert proc.stop() == 0, proc.log_text()[-3000:]


def expected_text(served: dict[str, Any], prompt: str, images: list) -> str:
    ids = expanded(served["tokenizer"].encode(prompt), TOKENS_PER_IMAGE)
    tokens = hf_greedy_with_images(served["hf"], served["folder"], ids, images, NEW_TOKENS)
    return served["tokenizer"].decode(tokens, skip_special_tokens=True)


def data_url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def client(served: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served["proc"].url("/v1"), api_key="none", max_retries=0)


def test_chat_reads_images_from_data_and_http_urls(served) -> None:
    images = served["images"]
    want = expected_text(served, "USER: <image> w7 <image> w8 ASSISTANT:", images)
    for first, second in ((data_url(images[0]), f"{served['files_url']}/1.png"),
                          (f"{served['files_url']}/0.png", data_url(images[1]))):
        chat = client(served).chat.completions.create(
            model="model", max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": first}},
                {"type": "text", "text": "w7"},
                {"type": "image_url", "image_url": {"url": second}},
                {"type": "text", "text": "w8"}]}])
        assert chat.choices[0].message.content == want
        assert chat.usage.prompt_tokens == 4 + 2 * TOKENS_PER_IMAGE
    stream = client(served).chat.completions.create(
        model="model", max_tokens=NEW_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(images[0])}},
            {"type": "text", "text": "w7"},
            {"type": "image_url", "image_url": {"url": data_url(images[1])}},
            {"type": "text", "text": "w8"}]}])
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream
                   if chunk.choices) == want
    twice = client(served).chat.completions.create(  # n > 1: the warm-up carries the images
        model="model", max_tokens=NEW_TOKENS, temperature=0, n=2,
        extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(images[0])}},
            {"type": "text", "text": "w7"},
            {"type": "image_url", "image_url": {"url": data_url(images[1])}},
            {"type": "text", "text": "w8"}]}])
    assert [choice.message.content for choice in twice.choices] == [want, want]
    counted = requests.post(served["proc"].url("/tokenize"), timeout=60, json={
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(images[0])}},
            {"type": "text", "text": "w7"}]}]}).json()
    assert counted["count"] == 3 + TOKENS_PER_IMAGE  # as the chat route sends it


def test_responses_and_generate_read_images(served) -> None:
    image = served["images"][0]
    response = client(served).responses.create(
        model="model", max_output_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_text", "text": "w9"},
                                            {"type": "input_image",
                                             "image_url": data_url(image)}]}])
    assert response.output_text == expected_text(served, "USER: w9 <image> ASSISTANT:",
                                                  [image])
    local = str(served["media"] / "0.png")
    body = {"text": "w10 <image> w11", "image_data": local,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                "ignore_eos": True}}
    out = requests.post(served["proc"].url("/generate"), json=body, timeout=60).json()
    assert out["text"] == expected_text(served, "w10 <image> w11", [image])
    bare = base64.b64encode(png_bytes(image)).decode()  # SGLang's bare base64
    batch = dict(body, text=[body["text"], "w12 <image>"], image_data=[f"file://{local}",
                                                                      [bare]])
    outs = requests.post(served["proc"].url("/generate"), json=batch, timeout=60).json()
    assert outs[0]["text"] == out["text"]
    assert outs[1]["text"] == expected_text(served, "w12 <image>", [image])


@pytest.mark.parametrize("url,match", [
    ("data:image/png;base64,bm90IGFuIGltYWdl", "image 0: not a readable image"),
    ("data:image/png,raw", "must be base64"),
    ("/etc/hostname", "inside --allowed-local-media-path"),
    ("file:///etc/hostname", "inside --allowed-local-media-path"),
    ("http://127.0.0.1:9/x.png", "cannot fetch"),
    ("MISSING", "answered HTTP 404"),
])
def test_bad_images_are_400s_naming_them(served, url: str, match: str) -> None:
    if url == "MISSING":
        url = f"{served['files_url']}/missing.png"
    with pytest.raises(openai.BadRequestError, match=match):
        client(served).chat.completions.create(
            model="model", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}])


def test_placeholder_mismatch_is_a_400_and_nothing_leaks(served) -> None:
    proc = served["proc"]
    body = {"text": "w10 w11", "image_data": data_url(served["images"][0]),
            "sampling_params": {"max_new_tokens": 2}}
    response = requests.post(proc.url("/generate"), json=body, timeout=60)
    assert response.status_code == 400
    assert "0 image placeholder(s)" in response.json()["error"]["message"]
    response = requests.post(proc.url("/generate"), timeout=60, json={
        "text": ["w1 <image>", "w2 <image>"], "image_data": [data_url(served["images"][0])]})
    assert response.status_code == 400 and "one item per prompt" in response.text
    info = proc.wait_idle_memory_check()
    assert info["internal_state"]["memory_check_ok"] is True
    before = images_counted(proc)
    requests.post(proc.url("/generate"), timeout=60, json={
        "text": "w1 <image> <image>", "image_data": [data_url(served["images"][0])] * 2,
        "sampling_params": {"max_new_tokens": 1}}).raise_for_status()
    assert images_counted(proc) == before + 2


def images_counted(proc: ServerProcess) -> float:
    """/metrics' radixserve:image_inputs_total."""
    metrics = requests.get(proc.url("/metrics"), timeout=30).text
    line = next(line for line in metrics.splitlines()
                if line.startswith("radixserve:image_inputs_total{"))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("mode,fmt,size", [("L", "PNG", (5, 3)), ("RGBA", "PNG", (60, 90)),
                                           ("P", "GIF", (30, 30)), ("RGB", "JPEG", (1, 1)),
                                           ("CMYK", "JPEG", (300, 17))])
def test_any_pillow_image_is_read(served, mode: str, fmt: str, size: tuple) -> None:
    """Grey, transparent, palette, one pixel, CMYK: converted to RGB and answered."""
    import io
    buffer = io.BytesIO()
    noise_image(3, size).convert(mode).save(buffer, format=fmt)
    url = f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()
    chat = client(served).chat.completions.create(
        model="model", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}])
    assert chat.usage.prompt_tokens == 2 + TOKENS_PER_IMAGE
