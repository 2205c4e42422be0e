"""A tiny LLaVA checkpoint folder as a user would serve it: transformers' own weights
(tests/models/tiny_checkpoints.py "llava" / "llava_siglip"), a word-level tokenizer whose
"<image>" is the image token, a chat template that reads content parts as LLaVA-1.5's does,
and the image processor transformers' processors read (preprocessor_config.json); with the
greedy reference of transformers' own model on the same pixels."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from tests.models.tiny_checkpoints import make_checkpoint

VOCAB = 300
IMAGE_TOKEN = 299
SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<unk>", 4: "USER:", 5: "ASSISTANT:",
           6: "SYSTEM:", IMAGE_TOKEN: "<image>"}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }} {% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image> "
    "{% elif item['type'] == 'text' %}{{ item['text'] }} {% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT: {% endif %}")


def write_llava_folder(folder: Path, name: str = "llava") -> torch.nn.Module:
    """The checkpoint, tokenizer and image processor in `folder`; transformers' model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, PreTrainedTokenizerFast, SiglipImageProcessor

    hf_model = make_checkpoint(name, folder).eval()
    vocab = {SPECIAL.get(i, f"w{i}"): i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                        additional_special_tokens=["<image>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    side = hf_model.config.vision_config.image_size
    if name == "llava":
        processor = CLIPImageProcessor(size={"shortest_edge": side},
                                       crop_size={"height": side, "width": side})
    else:
        processor = SiglipImageProcessor(size={"height": side, "width": side})
    processor.save_pretrained(str(folder))
    return hf_model


def noise_image(seed: int, size: tuple[int, int] = (45, 37)) -> Any:
    """A random RGB PIL image (width, height)."""
    from PIL import Image
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def png_bytes(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def expanded(ids: list[int], tokens_per_image: int) -> list[int]:
    """A prompt's ids with each image token repeated as its features fill it."""
    out: list[int] = []
    for token in ids:
        out.extend([token] * (tokens_per_image if token == IMAGE_TOKEN else 1))
    return out


def hf_greedy_with_images(hf_model: torch.nn.Module, folder: Path, ids: list[int],
                          images: list[Any], new_tokens: int) -> list[int]:
    """transformers' greedy tokens for an expanded prompt and its images, one full forward
    per token, the pixels from the folder's image processor."""
    from transformers import AutoImageProcessor
    processor = AutoImageProcessor.from_pretrained(str(folder))
    pixels = processor(images=images, return_tensors="pt")["pixel_values"] if images else None
    ids = list(ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = hf_model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits
            out.append(int(logits[0, -1].argmax()))
            ids.append(out[-1])
    return out
