"""A tiny Qwen2-VL / Qwen2.5-VL checkpoint folder as a user would serve it: transformers' own
weights (tests/models/tiny_checkpoints.py "qwen2_vl" / "qwen2_5_vl"), a word-level tokenizer
with Qwen's vision tokens (<|vision_start|> 157, <|vision_end|> 158, <|image_pad|> 159), a chat
template that writes an image part as Qwen's does, and a small Qwen2VLImageProcessor (4x4
patches merged 2x2, at most 48x48 pixels); with transformers' greedy reference on the same
pixels, its positions from its own `get_rope_index`."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from tests.models.tiny_checkpoints import make_checkpoint

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 157, 158, 159, 156
SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<unk>", 4: "<|im_start|>", 5: "<|im_end|>",
           VIDEO_PAD: "<|video_pad|>", VISION_START: "<|vision_start|>",
           VISION_END: "<|vision_end|>", IMAGE_PAD: "<|image_pad|>"}
MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for item in m['content'] %}{% if item['type'] == 'image' %}"
    "<|vision_start|> <|image_pad|> <|vision_end|> "
    "{% elif item['type'] == 'text' %}{{ item['text'] }} {% endif %}{% endfor %}{% endif %}"
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
MAX_SIDE = 48


def image_processor() -> Any:
    from transformers import Qwen2VLImageProcessor
    return Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2,
                                 min_pixels=8 * 8, max_pixels=MAX_SIDE * MAX_SIDE)


def write_qwen_vl_folder(folder: Path, name: str) -> torch.nn.Module:
    """The checkpoint, tokenizer and image processor in `folder`; transformers' model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf_model = make_checkpoint(name, folder).eval()
    vocab_size = hf_model.config.get_text_config().vocab_size
    vocab = {SPECIAL.get(i, f"w{i}"): i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=[
            SPECIAL[i] for i in (4, 5, VIDEO_PAD, VISION_START, VISION_END, IMAGE_PAD)])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    image_processor().save_pretrained(str(folder))
    return hf_model


def hf_positions(hf_model: torch.nn.Module, ids: list[int], grids: torch.Tensor | None,
                 prompt_len: int | None = None) -> torch.Tensor:
    """transformers' 3-D positions [3, 1, len] of a prompt (its own get_rope_index; releases
    before 5.25 find the image tokens without mm_token_type_ids), the image pads among the
    first `prompt_len` ids (all: None) the images' (a generated pad id is text)."""
    input_ids = torch.tensor([ids])
    if grids is None:
        return torch.arange(len(ids)).view(1, 1, -1).expand(3, 1, -1)
    get_rope_index = hf_model.model.get_rope_index
    kwargs: dict[str, Any] = {"image_grid_thw": grids}
    if "mm_token_type_ids" in inspect.signature(get_rope_index).parameters:
        images = input_ids == IMAGE_PAD
        images[0, len(ids) if prompt_len is None else prompt_len:] = False
        kwargs["mm_token_type_ids"] = images.int()
    positions, _ = get_rope_index(input_ids, **kwargs)
    return positions


def expand(ids: list[int], grids: torch.Tensor | None, merge: int = 2) -> list[int]:
    """Each <|image_pad|> made its image's (h / merge) x (w / merge) pads."""
    sizes = iter([] if grids is None else [int(t * h * w) // merge ** 2
                                           for t, h, w in grids.tolist()])
    out: list[int] = []
    for token in ids:
        out.extend([token] * (next(sizes) if token == IMAGE_PAD else 1))
    return out


def hf_logits(hf_model: torch.nn.Module, ids: list[int], pixels: Any,
              prompt_len: int | None = None) -> torch.Tensor:
    """transformers' logits [len, vocab] of an expanded prompt (its first `prompt_len` ids;
    all: None) and what follows, the processor's output for its images: the embeddings with the
    prompt's pads replaced by `get_image_features`, at `hf_positions` (a generated pad id stays
    a token)."""
    input_ids = torch.tensor([ids])
    prompt_len = len(ids) if prompt_len is None else prompt_len
    with torch.no_grad():
        embeds = hf_model.get_input_embeddings()(input_ids)
        grids, deepstack = None, {}
        if pixels is not None:
            grids = pixels["image_grid_thw"]
            features, extra = hf_image_features(hf_model, pixels)
            pads = (input_ids[0] == IMAGE_PAD) & (torch.arange(len(ids)) < prompt_len)
            embeds[0, pads] = features.to(embeds.dtype)
            if extra:  # Qwen3-VL: what the first layers add at the image's tokens
                deepstack = {"visual_pos_masks": pads[None], "deepstack_visual_embeds": extra}
        positions = hf_positions(hf_model, ids, grids, prompt_len)
        if not deepstack:
            return hf_model(inputs_embeds=embeds, position_ids=positions).logits[0]
        hidden = hf_model.model.language_model(inputs_embeds=embeds, position_ids=positions,
                                               **deepstack).last_hidden_state
        return hf_model.lm_head(hidden)[0]


def hf_image_features(hf_model: torch.nn.Module, pixels: Any
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' features of the processor's images, every image's rows in order, and
    Qwen3-VL's DeepStack rows per layer (empty elsewhere)."""
    out = hf_model.model.get_image_features(pixel_values=pixels["pixel_values"],
                                            image_grid_thw=pixels["image_grid_thw"],
                                            return_dict=True)

    def rows(value: Any) -> torch.Tensor:
        return torch.cat(list(value)) if isinstance(value, (list, tuple)) else value

    extra = getattr(out, "deepstack_features", None) or []
    return rows(out.pooler_output), [rows(layer) for layer in extra]


def hf_greedy(hf_model: torch.nn.Module, prompt_ids: list[int], images: list[Any],
              new_tokens: int) -> list[int]:
    """transformers' greedy tokens for a prompt with one <|image_pad|> per image, one full
    forward per token."""
    pixels = image_processor()(images=images, return_tensors="pt") if images else None
    ids = expand(prompt_ids, None if pixels is None else pixels["image_grid_thw"])
    prompt_len = len(ids)
    out: list[int] = []
    for _ in range(new_tokens):
        out.append(int(hf_logits(hf_model, ids, pixels, prompt_len)[-1].argmax()))
        ids.append(out[-1])
    return out
