"""Images through the offline Engine on a tiny LLaVA checkpoint (tests/models/llava_folder.py):
prompts with "<image>" markers and their images (PIL, bytes, paths) generate transformers'
greedy tokens on the same pixels, chunked through an image's placeholders, batched with other
images; the prefix cache shares KV past an image only for the same pixels; Engine.chat renders
image parts; bad image input is refused with a message."""
from __future__ import annotations

import base64

import pytest

import radixserve
from radixserve.config import ServerArgs
from radixserve.core.sampling_params import InvalidRequestError
from tests.models.llava_folder import (expanded, hf_greedy_with_images, noise_image,
                                       png_bytes, write_llava_folder)

NEW_TOKENS = 6
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
TOKENS_PER_IMAGE = 16  # the "llava" checkpoint: 4 x 4 patches, the class token dropped


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava")
    hf_model = write_llava_folder(folder)
    # chunks of 24 tokens cut through the images' 16 placeholders
    engine = radixserve.Engine(str(folder), dtype="float32", max_total_tokens=4096,
                               chunked_prefill_size=24)
    yield hf_model, folder, engine
    engine.shutdown()


def reference(llava, prompt: str, images: list) -> list[int]:
    hf_model, folder, engine = llava
    ids = expanded(engine.tokenizer.encode(prompt), TOKENS_PER_IMAGE)
    return hf_greedy_with_images(hf_model, folder, ids, images, NEW_TOKENS)


def test_prompts_with_images_generate_as_transformers(llava, tmp_path) -> None:
    engine = llava[2]
    images = [noise_image(seed) for seed in (1, 2, 3)]
    path = tmp_path / "third.png"
    path.write_bytes(png_bytes(images[2]))
    prompts = ["w5 w6 <image> w7 w8 w9", "w9 <image> w10 w11 w12 w13 w14 w15 w16 <image> w17"]
    out = engine.generate(prompts, GREEDY, image_data=[images[0], [png_bytes(images[1]),
                                                                   str(path)]])
    assert out[0]["output_ids"] == reference(llava, prompts[0], images[:1])
    assert out[1]["output_ids"] == reference(llava, prompts[1], images[1:])
    assert out[1]["meta_info"]["prompt_tokens"] == 9 + 2 * TOKENS_PER_IMAGE


def test_cached_prefixes_are_shared_through_an_image_only_for_its_pixels(llava) -> None:
    engine = llava[2]
    first, other = noise_image(11), noise_image(12)
    prompt = "w20 w21 w22 <image> w23 w24"
    a = engine.generate(prompt, GREEDY, image_data=first, return_logprob=True)
    b = engine.generate(prompt, GREEDY, image_data=other, return_logprob=True)
    assert b["output_ids"] == reference(llava, prompt, [other])
    assert b["meta_info"]["cached_tokens"] <= 3  # up to the image only
    logprobs = [[entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
                for out in (a, b)]
    assert logprobs[0] != pytest.approx(logprobs[1], abs=1e-4)  # the image matters
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(first)).decode()
    again = engine.generate(prompt, GREEDY, image_data=data_url)
    assert again["output_ids"] == a["output_ids"] == reference(llava, prompt, [first])
    assert again["meta_info"]["cached_tokens"] >= 3 + TOKENS_PER_IMAGE


def test_chat_renders_image_parts(llava) -> None:
    engine = llava[2]
    image = noise_image(21)
    turns = [{"role": "system", "content": "w30"},
             {"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                          {"type": "text", "text": "w31 w32"}]}]
    out = engine.chat(turns, GREEDY)
    assert out["output_ids"] == reference(
        llava, "SYSTEM: w30 USER: <image> w31 w32 ASSISTANT:", [image])


@pytest.mark.parametrize("prompt,image_data,match", [
    ("w5 w6", "IMAGE", r"0 image placeholder\(s\) \('<image>'\) for 1 image"),
    ("w5 <image> w6 <image>", "IMAGE", r"2 image placeholder\(s\)"),
    ("w5 <image>", None, r"1 image placeholder\(s\) \('<image>'\) for 0 image"),
    ("w5 <image>", "bm90IGFuIGltYWdl", "image 0: not a readable image"),
    ("w5 <image>", "no such file or base64 !", "image 0: not a URL, a readable path"),
    ("w5 <image>", 17, "image 0: an image must be"),
])
def test_bad_image_input_is_refused(llava, prompt, image_data, match) -> None:
    engine = llava[2]
    if image_data == "IMAGE":
        image_data = noise_image(1)
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate(prompt, GREEDY, image_data=image_data)
    with pytest.raises(InvalidRequestError, match="one item per prompt"):
        engine.generate([prompt, prompt], GREEDY, image_data=[noise_image(1)])
    assert engine.get_internal_state()["num_running_reqs"] == 0


def test_a_siglip_llava_generates_as_transformers(tmp_path) -> None:
    """The SigLIP tower, every feature kept ("full": 36 tokens an image), a Qwen2 decoder."""
    hf_model = write_llava_folder(tmp_path, "llava_siglip")
    engine = radixserve.Engine(str(tmp_path), dtype="float32", max_total_tokens=2048)
    try:
        image = noise_image(5, (30, 50))
        prompt = "w40 <image> w41 w42"
        out = engine.generate(prompt, GREEDY, image_data=image)
        ids = expanded(engine.tokenizer.encode(prompt), 36)
        assert out["output_ids"] == hf_greedy_with_images(hf_model, tmp_path, ids, [image],
                                                          NEW_TOKENS)
    finally:
        engine.shutdown()


@pytest.mark.slow  # 11 s
def test_images_at_tp2_generate_as_transformers(llava) -> None:
    """Tensor parallel over gloo: every rank gets the request's images with it (its own
    vision tower, replicated) and the decoder split as for text; tokens as transformers'."""
    folder = llava[1]
    engine = radixserve.Engine(str(folder), dtype="float32", max_total_tokens=2048,
                               chunked_prefill_size=24, tp_size=2)
    try:
        images = [noise_image(seed) for seed in (41, 42)]
        prompts = ["w50 <image> w51", "<image> w52 w53 <image>"]
        out = engine.generate(prompts, GREEDY, image_data=[images[0], images])
    finally:
        engine.shutdown()
    assert out[0]["output_ids"] == reference(llava, prompts[0], images[:1])
    assert out[1]["output_ids"] == reference(llava, prompts[1], images)


def test_images_per_prompt_are_limited(llava) -> None:
    """--limit-mm-per-prompt (vLLM's JSON): more images than it allows, or any with 0, are
    refused before they are read; a bad value is refused at start. --allowed-media-domains:
    a URL of another host is refused before it is fetched."""
    folder = llava[1]
    engine = radixserve.Engine(str(folder), dtype="float32", max_total_tokens=1024,
                               limit_mm_per_prompt='{"image": 1}',
                               allowed_media_domains=["Images.Example.org"])
    try:
        engine.generate("w1 <image>", GREEDY, image_data=noise_image(1))
        with pytest.raises(InvalidRequestError, match="'127.0.0.1' is not among "
                                                      "--allowed-media-domains"):
            engine.generate("w1 <image>", GREEDY, image_data="http://127.0.0.1:9/x.png")
        assert engine._images.allowed_domains == {"images.example.org"}
        with pytest.raises(InvalidRequestError, match=r"2 images in one prompt; at most 1"):
            engine.generate("w1 <image> <image>", GREEDY, image_data=[noise_image(1)] * 2)
        assert ServerArgs(limit_mm_per_prompt='{"image": 0}').max_images_per_prompt() == 0
        engine._images.max_images = 0  # as '{"image": 0}' makes it
        with pytest.raises(InvalidRequestError, match=r"images are refused"):
            engine.generate("w1 <image>", GREEDY, image_data=noise_image(1))
        assert engine.generate("w1 w2", GREEDY)["output_ids"]  # text still served
    finally:
        engine.shutdown()
    for bad, match in (('{"image": -1}', "counts >= 0"), ('{"pictures": 2}', "unknown modality"),
                       ("[3]", "JSON object"), ("{", "not JSON")):
        with pytest.raises(ValueError, match=match):
            ServerArgs(model_path=str(folder), limit_mm_per_prompt=bad).resolve()
