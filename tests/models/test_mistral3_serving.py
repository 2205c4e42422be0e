"""Mistral Small 3.1 / 3.2's images through the offline Engine (tiny random
Mistral3ForConditionalGeneration, tests/models/tiny_checkpoints.py "mistral3_multimodal", a
word-level tokenizer with [IMG] / [IMG_BREAK] / [IMG_END], a PixtralImageProcessor): each
[IMG] becomes its image's rows of image tokens and breaks, by the processed size; images of
different sizes in one prompt and a small chunked-prefill size that cuts through them; greedy
tokens equal transformers' on the processor's padded pixels and image sizes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import radixserve
from radixserve.core.sampling_params import InvalidRequestError
from tests.models.llava_folder import noise_image
from tests.models.tiny_checkpoints import make_checkpoint

NEW_TOKENS = 6
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
BREAK, END = 12, 13
SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<unk>", BREAK: "[IMG_BREAK]", END: "[IMG_END]"}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '[INST]' if m['role'] == 'user' else '' }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for item in m['content'] %}{% if item['type'] == 'image' %}[IMG] "
    "{% elif item['type'] == 'text' %}{{ item['text'] }} {% endif %}{% endfor %}{% endif %}"
    "{{ '[/INST]' if m['role'] == 'user' else '' }} {% endfor %}")


def write_tokenizer(folder: Path, vocab_size: int, image_token: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    special = {**SPECIAL, image_token: "[IMG]", 4: "[INST]", 5: "[/INST]"}
    vocab = {special.get(i, f"w{i}"): i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=["[IMG]", "[IMG_BREAK]", "[IMG_END]",
                                                     "[INST]", "[/INST]"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    from transformers import PixtralImageProcessor
    folder = tmp_path_factory.mktemp("mistral3_images")
    hf_model = make_checkpoint("mistral3_multimodal", folder).eval()
    config = hf_model.config
    write_tokenizer(folder, config.text_config.vocab_size, config.image_token_index)
    side = config.vision_config.image_size
    PixtralImageProcessor(size={"longest_edge": side}).save_pretrained(str(folder))
    engine = radixserve.Engine(str(folder), dtype="float32", max_total_tokens=4096,
                               chunked_prefill_size=8)
    yield hf_model, folder, engine
    engine.shutdown()


def reference(hf_model, folder: Path, prompt_ids: list[int], images: list) -> list[int]:
    """transformers' greedy tokens: the processor's pixels (a batch padded) and sizes, each
    [IMG] laid out as its processor writes it."""
    from transformers import AutoImageProcessor
    config = hf_model.config
    patch = config.vision_config.patch_size * config.spatial_merge_size
    processed = AutoImageProcessor.from_pretrained(str(folder))(
        images=images, return_tensors="pt", patch_size={"height": patch, "width": patch})
    ids: list[int] = []
    sizes = iter(processed["image_sizes"].tolist())
    for token in prompt_ids:
        if token != config.image_token_index:
            ids.append(token)
            continue
        height, width = next(sizes)
        layout = ([token] * (width // patch) + [BREAK]) * (height // patch)
        layout[-1] = END
        ids.extend(layout)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = hf_model(input_ids=torch.tensor([ids]),
                              pixel_values=processed["pixel_values"],
                              image_sizes=processed["image_sizes"]).logits
            out.append(int(logits[0, -1].argmax()))
            ids.append(out[-1])
    return out


def test_images_of_any_size_generate_as_transformers(mistral3) -> None:
    hf_model, folder, engine = mistral3
    images = [noise_image(71, (90, 50)), noise_image(72, (40, 64)), noise_image(73, (64, 64))]
    prompts = ["w20 [IMG] w21 w22", "w23 [IMG] w24 [IMG] w25"]
    out = engine.generate(prompts, GREEDY, image_data=[images[0], images[1:]])
    for result, prompt, pics in zip(out, prompts, ([images[0]], images[1:])):
        assert result["output_ids"] == reference(hf_model, folder,
                                                 engine.tokenizer.encode(prompt), pics)
    turns = [{"role": "user", "content": [{"type": "image_pil", "image_pil": images[1]},
                                          {"type": "text", "text": "w26"}]}]
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w26"}]}],
        tokenize=False)
    assert engine.chat(turns, GREEDY)["output_ids"] == reference(
        hf_model, folder, engine.tokenizer.encode(text, add_special_tokens=False), [images[1]])


def test_an_expanded_layout_in_the_prompt_is_refused(mistral3) -> None:
    engine = mistral3[2]
    with pytest.raises(InvalidRequestError, match="one '\\[IMG\\]' per image"):
        engine.generate("w20 [IMG] [IMG_BREAK] w21", GREEDY, image_data=noise_image(1))
