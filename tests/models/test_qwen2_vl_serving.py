"""Qwen2.5-VL's and Qwen3.5's images through the offline Engine (tiny random
Qwen2_5_VLForConditionalGeneration and Qwen3_5ForConditionalGeneration, a hybrid of linear and
full attention whose prefix cache keeps recurrent states; tests/models/qwen_vl_folder.py): each <|image_pad|> becomes its image's grid of pads by the
processed size, and the scheduler's passes place the tokens after an image at their index plus
its rope delta. A small chunked-prefill size cuts prompts inside images; greedy tokens equal
transformers' with its own 3-D positions, for prompts with images of different sizes, the chat
route's image parts, a prompt served again from the radix cache, and the same prompt with
another image (no cached tokens past the image)."""
from __future__ import annotations


import pytest

import radixserve
from radixserve.core.sampling_params import InvalidRequestError
from tests.models.llava_folder import noise_image
from tests.models.qwen_vl_folder import IMAGE_PAD, MARKER, hf_greedy, write_qwen_vl_folder

NEW_TOKENS = 6
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_5_vl"])
def qwen_vl(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"{request.param}_serving")
    hf_model = write_qwen_vl_folder(folder, request.param)
    engine = radixserve.Engine(str(folder), dtype="float32", max_total_tokens=4096,
                               chunked_prefill_size=8)
    yield hf_model, folder, engine
    engine.shutdown()


def test_images_of_any_size_generate_as_transformers(qwen_vl) -> None:
    hf_model, _, engine = qwen_vl
    images = [noise_image(71, (45, 30)), noise_image(72, (40, 64)), noise_image(73, (20, 20))]
    prompts = [f"w20 {MARKER} w21 w22", f"w23 {MARKER} w24 {MARKER} w25 w26"]
    out = engine.generate(prompts, GREEDY, image_data=[images[0], images[1:]])
    for result, prompt, pics in zip(out, prompts, ([images[0]], images[1:])):
        assert result["output_ids"] == hf_greedy(hf_model, engine.tokenizer.encode(prompt),
                                                 pics, NEW_TOKENS)
    turns = [{"role": "user", "content": [{"type": "image_pil", "image_pil": images[1]},
                                          {"type": "text", "text": "w26"}]}]
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w26"}]}],
        tokenize=False, add_generation_prompt=True)
    assert engine.chat(turns, GREEDY)["output_ids"] == hf_greedy(
        hf_model, engine.tokenizer.encode(text, add_special_tokens=False), [images[1]],
        NEW_TOKENS)


def test_cached_prompt_and_another_image(qwen_vl) -> None:
    """The same prompt and image again reuses the cached prefix through the image and gives
    the same tokens; another image in the same prompt reuses nothing past its start."""
    hf_model, _, engine = qwen_vl
    prompt = f"w30 w31 w32 w33 w34 w35 w36 w37 w38 {MARKER} w39 w40 w41"
    first, second = noise_image(81, (48, 40)), noise_image(82, (48, 40))
    cold = engine.generate(prompt, GREEDY, image_data=first)
    warm = engine.generate(prompt, GREEDY, image_data=first)
    other = engine.generate(prompt, GREEDY, image_data=second)
    ids = engine.tokenizer.encode(prompt)
    assert warm["output_ids"] == cold["output_ids"] == hf_greedy(hf_model, ids, [first],
                                                                   NEW_TOKENS)
    image_start = ids.index(IMAGE_PAD)
    assert warm["meta_info"]["cached_tokens"] > image_start + 20  # past the image's pads
    assert other["meta_info"]["cached_tokens"] <= image_start
    assert other["output_ids"] == hf_greedy(hf_model, ids, [second], NEW_TOKENS)


def test_placeholders_without_their_image_are_refused(qwen_vl) -> None:
    engine = qwen_vl[2]
    with pytest.raises(InvalidRequestError, match="image placeholder"):
        engine.generate(f"w20 {MARKER} w21 {MARKER}", GREEDY, image_data=noise_image(1))


@pytest.mark.slow  # 10 s: two gloo ranks
def test_images_at_tp2_generate_as_transformers(qwen_vl) -> None:
    """Tensor parallel over gloo: every rank gets the images and the passes' position offsets,
    runs its own (replicated) tower and its half of the decoder; tokens as transformers'."""
    hf_model, folder, _ = qwen_vl
    engine = radixserve.Engine(str(folder), dtype="float32", max_total_tokens=2048,
                               chunked_prefill_size=8, tp_size=2)
    try:
        images = [noise_image(91, (40, 44)), noise_image(92, (24, 48))]
        prompt = f"w20 {MARKER} w21 {MARKER} w22"
        out = engine.generate(prompt, GREEDY, image_data=images)
    finally:
        engine.shutdown()
    assert out["output_ids"] == hf_greedy(hf_model, engine.tokenizer.encode(prompt), images,
                                          NEW_TOKENS)


def test_processor_overrides_bound_an_images_tokens(qwen_vl) -> None:
    """--mm-processor-kwargs (vLLM's JSON): the image processor built with max_pixels 256
    makes a 48x40 image 8x16 pixels, 1x2 tokens (5x6 without it: 2x2 patches of 4 pixels
    a token)."""
    hf_model, folder, engine = qwen_vl
    if hf_model.config.model_type != "qwen2_5_vl":
        pytest.skip("the processor is the same for every Qwen VL model")
    prompt, image = f"w20 {MARKER} w21", noise_image(83, (48, 40))
    wide = engine.generate(prompt, GREEDY, image_data=image)
    small = radixserve.Engine(str(folder), dtype="float32", max_total_tokens=1024,
                              mm_processor_kwargs='{"max_pixels": 256}')
    try:
        out = small.generate(prompt, GREEDY, image_data=image)
    finally:
        small.shutdown()
    text_tokens = len(engine.tokenizer.encode(prompt)) - 1
    assert wide["meta_info"]["prompt_tokens"] == text_tokens + 30
    assert out["meta_info"]["prompt_tokens"] == text_tokens + 2
    with pytest.raises(ValueError, match="must be a JSON object"):
        radixserve.Engine(str(folder), mm_processor_kwargs="[1]")
