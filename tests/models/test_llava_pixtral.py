"""pixtral-12b's kind of checkpoint (LlavaForConditionalGeneration around a Pixtral tower, LLaVA's
projector, "full", layer -1) against transformers' on a tiny random checkpoint it saved itself
(fp32, tests/models/tiny_checkpoints.py "llava_pixtral": 8x8 patches, no merge, images up to 64
pixels a side). Images go through PixtralImageProcessor with patch 8 (the tower's own); each
ImageInput holds its own processed pixels and its grid of (H / 8) x (W / 8) image tokens, laid
out as Pixtral's rows of image tokens and [IMG_BREAK] (12), the last row's [IMG_END] (13).

The features against `get_image_features(..., image_sizes=...).pooler_output`; the last-token
logits through a ModelRunner against transformers' forward with the padded pixels and
image_sizes (one image, two of different sizes, a prompt cut inside an image over two passes);
transformers' module-name layout; the Engine's greedy tokens against transformers'."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file

import radixserve
from radixserve.config import ServerArgs
from radixserve.core.multimodal import ImageInput, grid_tokens, pixels_hash
from radixserve.executor.model_runner import ModelRunner
from tests.models.llava_folder import noise_image
from tests.models.runner_driver import RunnerDriver
from tests.models.test_llava import Counted
from tests.models.test_mistral3_images import (Pixels, as_module_names, hf_image_features,
                                               hf_last_logits)
from tests.models.test_mistral3_serving import BREAK, END, GREEDY, NEW_TOKENS, write_tokenizer
from tests.models.tiny_checkpoints import make_checkpoint

NAME = "llava_pixtral"
PATCH = 8  # the tower's patch: one image token per 8x8 pixels
SIDE = 64  # the processor's longest edge
ATOL = 2e-5
# (height, width) of the PIL images: processed to 32x56, 64x24, 40x40, 64x56 pixels
SIZES = [(30, 50), (61, 23), (40, 40), (100, 80)]


def make_runner(folder: Path) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu",
                                  max_total_tokens=4096, max_running_requests=8))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp(NAME)
    return make_checkpoint(NAME, folder), folder


@pytest.fixture(scope="module")
def pair(checkpoint) -> tuple[torch.nn.Module, ModelRunner]:
    hf_model, folder = checkpoint
    return hf_model, make_runner(folder)


def image_processor() -> transformers.PixtralImageProcessor:
    return transformers.PixtralImageProcessor(size={"longest_edge": SIDE},
                                              patch_size={"height": PATCH, "width": PATCH})


def processed(sizes: list[tuple[int, int]], seed: int) -> Pixels:
    """Random images of `sizes` (height, width) as pixtral-12b's processor makes them."""
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for h, w in sizes]
    out = image_processor()(images=images, return_tensors="pt")
    return Pixels(out["pixel_values"], [tuple(s) for s in out["image_sizes"].tolist()])


def prompt_with_images(runner: ModelRunner, pixels: Pixels, texts: list[int],
                       seed: int) -> tuple[list[int], list[ImageInput]]:
    """texts[0] text ids, the first image's span, texts[1] text ids, ... (one more text run
    than images); the ImageInputs of the spans."""
    spec = runner.vision_spec
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    images = []
    for i, text_len in enumerate(texts):
        ids += torch.randint(END + 1, spec.image_token_id, (text_len,), generator=gen).tolist()
        if i < len(pixels.each):
            (height, width), own = pixels.sizes[i], pixels.each[i]
            grid = (height // PATCH, width // PATCH)
            span = grid_tokens(spec, grid)
            images.append(ImageInput(own, len(ids), len(span), pixels_hash(own), grid=grid))
            ids += span
    return ids, images


def test_vision_spec_is_pixtrals_layout(pair) -> None:
    hf_model, runner = pair
    spec = runner.vision_spec
    assert (spec.image_token_id, spec.grid_patch, spec.tokens_per_image) == (159, PATCH, 0)
    assert (spec.break_token_id, spec.end_token_id) == (BREAK, END)
    assert runner.model.checkpoint_prefixes["vision_tower."] == "vision_tower."


def test_encode_images_equals_transformers(pair) -> None:
    hf_model, runner = pair
    pixels = processed(SIZES, seed=0)
    assert pixels.sizes == [(32, 56), (64, 24), (40, 40), (64, 56)]
    for own, (height, width), want in zip(pixels.each, pixels.sizes,
                                          hf_image_features(hf_model, pixels)):
        got = runner.model.encode_images(own[None])
        assert got.shape == (1, (height // PATCH) * (width // PATCH), want.shape[-1])
        torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
    same = processed([(30, 50), (31, 55)], seed=1)  # two images of one processed size
    torch.testing.assert_close(runner.model.encode_images(torch.stack(same.each)),
                               torch.stack(hf_image_features(hf_model, same)), atol=1e-5,
                               rtol=1e-5)


def test_the_vision_weights_are_loaded(checkpoint, pair) -> None:
    tensors = load_file(str(checkpoint[1] / "model.safetensors"))
    params = dict(pair[1].model.named_parameters())
    vision = [n for n in tensors if n.startswith(("vision_tower.", "multi_modal_projector."))]
    assert len(vision) == 4 + 2 + 9 * 2  # projector; conv, ln_pre; 9 a layer
    for name in vision:
        torch.testing.assert_close(params[name], tensors[name], atol=0, rtol=0)


def test_prompt_with_one_image(pair) -> None:
    hf_model, runner = pair
    pixels = processed(SIZES[:1], seed=3)
    ids, images = prompt_with_images(runner, pixels, [5, 7], seed=3)
    logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


def test_prompt_with_two_images_of_different_sizes(pair) -> None:
    hf_model, runner = pair
    pixels = processed(SIZES[1:3], seed=4)
    ids, images = prompt_with_images(runner, pixels, [5, 3, 9], seed=4)
    with Counted(runner.model) as counted:
        logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    assert counted.calls == [1, 1]  # one batch per size
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


def test_prompt_cut_inside_an_image_encodes_it_once(pair) -> None:
    hf_model, runner = pair
    pixels = processed(SIZES[3:], seed=5)
    ids, images = prompt_with_images(runner, pixels, [6, 8], seed=5)
    cut = images[0].offset + 2 * 8 + 3  # inside the third row of an 8 x 7 grid
    driver = RunnerDriver(runner)
    with Counted(runner.model) as counted:
        driver.extend({0: ids[:cut]}, mm_inputs={0: images})
        logits = driver.extend({0: ids[cut:]}, mm_inputs={0: images})[0]
    assert counted.calls == [1]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


def test_the_module_name_layout_loads(checkpoint, tmp_path) -> None:
    hf_model, folder = checkpoint
    for item in folder.iterdir():
        if item.name != "model.safetensors":
            (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({as_module_names(n): t for n, t in tensors.items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    runner = make_runner(tmp_path)
    pixels = processed(SIZES[:2], seed=6)
    ids, images = prompt_with_images(runner, pixels, [3, 4, 5], seed=6)
    logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


@pytest.fixture(scope="module")
def served(checkpoint):
    hf_model, folder = checkpoint
    write_tokenizer(folder, hf_model.config.text_config.vocab_size,
                    hf_model.config.image_token_index)
    image_processor().save_pretrained(str(folder))
    engine = radixserve.Engine(str(folder), dtype="float32", max_total_tokens=4096,
                               chunked_prefill_size=8)
    yield hf_model, engine
    engine.shutdown()


def reference(hf_model: torch.nn.Module, prompt_ids: list[int], images: list) -> list[int]:
    """transformers' greedy tokens: the processor's padded pixels and sizes, each [IMG] laid
    out as pixtral-12b's processor writes it."""
    out = image_processor()(images=images, return_tensors="pt")
    pixels = Pixels(out["pixel_values"], [tuple(s) for s in out["image_sizes"].tolist()])
    image_token = hf_model.config.image_token_index
    sizes = iter(pixels.sizes)
    ids: list[int] = []
    for token in prompt_ids:
        if token != image_token:
            ids.append(token)
            continue
        height, width = next(sizes)
        layout = ([token] * (width // PATCH) + [BREAK]) * (height // PATCH)
        ids.extend(layout[:-1] + [END])
    generated: list[int] = []
    for _ in range(NEW_TOKENS):
        generated.append(int(hf_last_logits(hf_model, ids, pixels).argmax()))
        ids.append(generated[-1])
    return generated


def test_images_of_any_size_generate_as_transformers(served) -> None:
    hf_model, engine = served
    images = [noise_image(71, (90, 50)), noise_image(72, (40, 64)), noise_image(73, (64, 64))]
    prompts = ["w20 [IMG] w21 w22", "w23 [IMG] w24 [IMG] w25"]
    out = engine.generate(prompts, GREEDY, image_data=[images[0], images[1:]])
    for result, prompt, pics in zip(out, prompts, ([images[0]], images[1:])):
        assert result["output_ids"] == reference(hf_model, engine.tokenizer.encode(prompt), pics)
    assert out[0]["meta_info"]["prompt_tokens"] == 3 + 5 * (8 + 1)  # 40x64 pixels: 5 x 8
