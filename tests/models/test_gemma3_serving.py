"""Gemma-3's images through the offline Engine (tiny random Gemma3ForConditionalGeneration,
tests/models/tiny_checkpoints.py "gemma3_multimodal", with its word-level tokenizer and a
Gemma3ImageProcessor): the text's <start_of_image> becomes the processor's whole image
sequence, the image's tokens see each other both ways (transformers with token_type_ids), a
small chunked-prefill size never cuts an image, and the greedy tokens are transformers'."""
from __future__ import annotations

import pytest
import torch

import radixserve
from tests.models.llava_folder import noise_image
from tests.models.test_gemma3_multimodal import write_tokenizer
from tests.models.tiny_checkpoints import make_checkpoint

NEW_TOKENS = 6
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
BOI, EOI, SOFT = 157, 158, 159


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import Gemma3ImageProcessor
    folder = tmp_path_factory.mktemp("gemma3_images")
    hf_model = make_checkpoint("gemma3_multimodal", folder).eval()
    write_tokenizer(folder)
    side = hf_model.config.vision_config.image_size
    Gemma3ImageProcessor(size={"height": side, "width": side}).save_pretrained(str(folder))
    # chunks of 8 tokens: every image's run would be cut without the scheduler's care
    engine = radixserve.Engine(str(folder), dtype="float32", max_total_tokens=4096,
                               chunked_prefill_size=8)
    yield hf_model, folder, engine
    engine.shutdown()


def expanded(ids: list[int], tokens: int) -> list[int]:
    """The processor's ids: each <start_of_image> followed by its run and <end_of_image>."""
    out: list[int] = []
    for token in ids:
        out.extend([BOI] + [SOFT] * tokens + [EOI] if token == BOI else [token])
    return out


def hf_greedy(hf_model, folder, ids: list[int], images: list, bidirectional: bool = True
              ) -> list[int]:
    from transformers import AutoImageProcessor
    pixels = AutoImageProcessor.from_pretrained(str(folder))(
        images=images, return_tensors="pt")["pixel_values"]
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tensor = torch.tensor([ids])
            types = (tensor == SOFT).long() if bidirectional else None
            logits = hf_model(input_ids=tensor, pixel_values=pixels,
                              token_type_ids=types).logits
            out.append(int(logits[0, -1].argmax()))
            ids.append(out[-1])
    return out


def test_images_generate_as_transformers(gemma3) -> None:
    hf_model, folder, engine = gemma3
    tokens = hf_model.config.mm_tokens_per_image
    images = [noise_image(seed) for seed in (51, 52, 53)]
    prompts = ["w10 <start_of_image> w11 w12", "w13 w14 w15 <start_of_image> w16 "
               "<start_of_image> w17"]
    out = engine.generate(prompts, GREEDY, image_data=[images[0], images[1:]])
    for result, prompt, pics in zip(out, prompts, ([images[0]], images[1:])):
        ids = expanded(engine.tokenizer.encode(prompt), tokens)
        assert result["output_ids"] == hf_greedy(hf_model, folder, ids, pics)
    # the same image again: its prefix comes from the cache, whole
    again = engine.generate(prompts[0] + " w18", GREEDY, image_data=images[0])
    assert again["meta_info"]["cached_tokens"] >= 3 + tokens
    ids = expanded(engine.tokenizer.encode(prompts[0] + " w18"), tokens)
    assert again["output_ids"] == hf_greedy(hf_model, folder, ids, [images[0]])


def test_chat_writes_the_image_sequence(gemma3) -> None:
    hf_model, folder, engine = gemma3
    image = noise_image(61)
    turns = [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": image}}, {"type": "text", "text": "w20 w21"}]}]
    out = engine.chat(turns, GREEDY)
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w20 w21"}]}],
        tokenize=False, add_generation_prompt=True)
    ids = expanded(engine.tokenizer.encode(text, add_special_tokens=False),
                   hf_model.config.mm_tokens_per_image)
    assert out["output_ids"] == hf_greedy(hf_model, folder, ids, [image])


@pytest.mark.slow  # (CI keeps LLaVA's tp 2 images test)
def test_images_at_tp2_generate_as_transformers(gemma3) -> None:
    """Tensor parallel over gloo: each rank's runner gives its pass the same attention limits,
    each rank's scheduler cuts chunks at the same image boundaries."""
    hf_model, folder, _ = gemma3
    engine = radixserve.Engine(str(folder), dtype="float32", max_total_tokens=2048,
                               chunked_prefill_size=8, tp_size=2)
    try:
        image = noise_image(81)
        prompt = "w30 w31 <start_of_image> w32 w33 w34"
        out = engine.generate(prompt, GREEDY, image_data=image)
        ids = expanded(engine.tokenizer.encode(prompt), hf_model.config.mm_tokens_per_image)
    finally:
        engine.shutdown()
    assert out["output_ids"] == hf_greedy(hf_model, folder, ids, [image])
