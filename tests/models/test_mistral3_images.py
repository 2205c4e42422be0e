"""Mistral Small 3.1 / 3.2's images (Mistral3ForConditionalGeneration: a Pixtral tower, Mistral3's
projector) against transformers' on a tiny random checkpoint it saved itself (fp32,
tests/models/tiny_checkpoints.py "mistral3_multimodal": 8x8 patches merged 2x2, images up to
64 pixels a side). Images are random PIL images of several sizes through PixtralImageProcessor
(longest_edge the tower's image_size, patch 16 = patch_size * spatial_merge_size, as Mistral3's
processor asks for); each one's ImageInput holds its own processed pixels and its grid, its span
in the prompt Pixtral's layout (per row, the image tokens then [IMG_BREAK], the last row's
[IMG_END]; 12 and 13 here, ordinary ids of the tiny vocabulary).

The features against `get_image_features(...).pooler_output` (the processor's padded batch and
image_sizes); the last-token logits through a ModelRunner against transformers' forward with
the padded pixels and image_sizes: one image, two of different sizes in one prompt, two
requests in one pass, a prompt cut over two passes inside an image's span (the second pass
reads the cached features); the placement of feature rows against `ImageInput.feature_index`;
vision_feature_layer -2 with projector biases; transformers' module-name layout; the
configurations refused."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file

from radixserve.config import ServerArgs
from radixserve.core.model_config import ModelConfig
from radixserve.core.multimodal import ImageInput, pixels_hash
from radixserve.executor.model_runner import ModelRunner
from radixserve.models.image_features import ImageSpan
from radixserve.models.llama import Mistral3ForConditionalGeneration
from tests.models.runner_driver import RunnerDriver
from tests.models.test_llava import Counted
from tests.models.tiny_checkpoints import MULTIMODAL_CONFIGS, make_checkpoint

NAME = "mistral3_multimodal"
BREAK, END = 12, 13
ATOL = 2e-5
# (height, width) of the PIL images: processed to 32x64, 64x32, 48x48, 64x64 (64 / 100 * 80
# = 51 -> 64) pixels, grids of 2x4, 4x2, 3x3, 4x4 image tokens
SIZES = [(30, 50), (61, 23), (40, 40), (100, 80)]


class Pixels:
    """Processed images: the processor's padded batch, each image's size and own pixels."""

    def __init__(self, batch: torch.Tensor, sizes: list[tuple[int, int]]) -> None:
        self.batch, self.sizes = batch, sizes
        self.each = [batch[i, :, :h, :w].clone() for i, (h, w) in enumerate(sizes)]


def make_runner(folder: Path) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu",
                                  max_total_tokens=4096, max_running_requests=32))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp(NAME)
    return make_checkpoint(NAME, folder), folder


@pytest.fixture(scope="module")
def pair(checkpoint) -> tuple[torch.nn.Module, ModelRunner]:
    hf_model, folder = checkpoint
    return hf_model, make_runner(folder)


def grid_patch(hf_model: torch.nn.Module) -> int:
    config = hf_model.config
    return config.vision_config.patch_size * config.spatial_merge_size


def processed(hf_model: torch.nn.Module, sizes: list[tuple[int, int]], seed: int) -> Pixels:
    """Random images of `sizes` (height, width) as Mistral3's processor makes them."""
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for h, w in sizes]
    patch = grid_patch(hf_model)
    processor = transformers.PixtralImageProcessor(
        size={"longest_edge": hf_model.config.vision_config.image_size},
        patch_size={"height": patch, "width": patch})
    out = processor(images=images, return_tensors="pt")
    return Pixels(out["pixel_values"], [tuple(s) for s in out["image_sizes"].tolist()])


def prompt_with_images(hf_model: torch.nn.Module, pixels: Pixels, texts: list[int],
                       seed: int) -> tuple[list[int], list[ImageInput]]:
    """texts[0] text ids, the first image's span, texts[1] text ids, ... (one more text run
    than images); the ImageInputs of the spans."""
    gen = torch.Generator().manual_seed(seed)
    image_token, patch = hf_model.config.image_token_index, grid_patch(hf_model)
    ids: list[int] = []
    images = []
    for i, text_len in enumerate(texts):
        ids += torch.randint(END + 1, image_token, (text_len,), generator=gen).tolist()
        if i < len(pixels.each):
            (height, width), own = pixels.sizes[i], pixels.each[i]
            rows, cols = height // patch, width // patch
            images.append(ImageInput(own, len(ids), rows * (cols + 1), pixels_hash(own),
                                     grid=(rows, cols)))
            span = ([image_token] * cols + [BREAK]) * rows
            span[-1] = END
            ids += span
    return ids, images


def hf_last_logits(hf_model: torch.nn.Module, ids: list[int],
                   pixels: Pixels | None) -> torch.Tensor:
    extra = {} if pixels is None else {"pixel_values": pixels.batch,
                                       "image_sizes": torch.tensor(pixels.sizes)}
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([ids]), **extra)
    return out.logits[0, -1].float()


def hf_image_features(hf_model: torch.nn.Module, pixels: Pixels) -> list[torch.Tensor]:
    """transformers 5.25: pooler_output is a tuple, per image [rows * cols, text hidden]."""
    with torch.no_grad():
        out = hf_model.model.get_image_features(pixel_values=pixels.batch,
                                                image_sizes=torch.tensor(pixels.sizes),
                                                return_dict=True)
    return list(out.pooler_output)


def check_features(model: torch.nn.Module, hf_model: torch.nn.Module, pixels: Pixels) -> None:
    expected = hf_image_features(hf_model, pixels)
    patch = grid_patch(hf_model)
    for own, (height, width), want in zip(pixels.each, pixels.sizes, expected):
        got = model.encode_images(own[None])
        assert got.shape == (1, (height // patch) * (width // patch), want.shape[-1])
        torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)


def test_encode_images_equals_transformers(pair) -> None:
    hf_model, runner = pair
    check_features(runner.model, hf_model, processed(hf_model, SIZES, seed=0))


def test_images_of_one_size_encode_together(pair) -> None:
    hf_model, runner = pair
    pixels = processed(hf_model, [(30, 50), (31, 60)], seed=1)
    assert pixels.sizes[0] == pixels.sizes[1]
    together = runner.model.encode_images(torch.stack(pixels.each))
    expected = hf_image_features(hf_model, pixels)
    torch.testing.assert_close(together, torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_the_vision_weights_are_loaded(checkpoint, pair) -> None:
    _, folder = checkpoint
    model = pair[1].model
    tensors = load_file(str(folder / "model.safetensors"))
    params = dict(model.named_parameters())
    vision = [n for n in tensors if n.startswith(("vision_tower.", "multi_modal_projector."))]
    assert len(vision) == 4 + 2 + 9 * 2  # projector; conv, ln_pre; 9 a layer
    for name in vision:
        torch.testing.assert_close(params[name], tensors[name], atol=0, rtol=0)
    assert len(model.vision_tower.transformer.layers) == 2


def test_placement_follows_feature_index() -> None:
    """Every window of a 3x4 grid's span (cut anywhere): the feature rows it writes and where,
    as `ImageInput.feature_index` says, break / end tokens left alone."""
    image = ImageInput(torch.zeros(3, 48, 64), 7, 3 * 5, 0, grid=(3, 4))
    for start in range(image.num_tokens):
        for length in range(1, image.num_tokens - start + 1):
            into, taken = ImageSpan(image, 2, start, length).placement(torch.device("cpu"))
            want = [(2 + j - start, image.feature_index(image.offset + j))
                    for j in range(start, start + length)]
            want = [(row, index) for row, index in want if index is not None]
            assert list(zip(into.tolist(), taken.tolist())) == want
    flat = ImageInput(torch.zeros(3, 4, 4), 3, 6, 0)
    assert ImageSpan(flat, 1, 2, 3).placement(torch.device("cpu")) == (slice(1, 4), slice(2, 5))


def test_text_only_prompt_runs_as_the_language_model(pair) -> None:
    hf_model, runner = pair
    ids, _ = prompt_with_images(hf_model, Pixels(torch.zeros(0, 3, 0, 0), []), [37], seed=2)
    logits = RunnerDriver(runner).extend({0: ids})[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, None), atol=ATOL,
                               rtol=1e-4)


def test_prompt_with_one_image(pair) -> None:
    hf_model, runner = pair
    pixels = processed(hf_model, SIZES[:1], seed=3)
    ids, images = prompt_with_images(hf_model, pixels, [5, 7], seed=3)
    with Counted(runner.model) as counted:
        logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    assert counted.calls == [1]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


def test_prompt_with_two_images_of_different_sizes(pair) -> None:
    hf_model, runner = pair
    pixels = processed(hf_model, SIZES[1:3], seed=4)
    ids, images = prompt_with_images(hf_model, pixels, [5, 3, 9], seed=4)
    with Counted(runner.model) as counted:
        logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    assert counted.calls == [1, 1]  # one batch per size
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


def test_two_requests_in_one_pass(pair) -> None:
    hf_model, runner = pair
    first_pixels = processed(hf_model, SIZES[3:], seed=5)
    second_pixels = processed(hf_model, SIZES[:2], seed=6)
    first = prompt_with_images(hf_model, first_pixels, [4, 11], seed=5)
    second = prompt_with_images(hf_model, second_pixels, [0, 7, 2], seed=6)
    with Counted(runner.model) as counted:
        logits = RunnerDriver(runner).extend({0: first[0], 1: second[0]},
                                             mm_inputs={0: first[1], 1: second[1]})
    assert sorted(counted.calls) == [1, 1, 1]
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, first[0], first_pixels),
                               atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_last_logits(hf_model, second[0], second_pixels),
                               atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("into_span", [6, 9, 10], ids=["mid_row", "at_a_break",
                                                       "after_a_break"])
def test_prompt_cut_inside_an_image_encodes_it_once(pair, into_span) -> None:
    """A 4x4 grid (rows of 5 tokens): the first pass ends inside the second row, on its break,
    or just after it; the second pass writes the rest from the cached features."""
    hf_model, runner = pair
    pixels = processed(hf_model, SIZES[3:], seed=7)
    ids, images = prompt_with_images(hf_model, pixels, [6, 8], seed=7)
    assert images[0].grid == (4, 4)
    cut = images[0].offset + into_span
    driver = RunnerDriver(runner)
    with Counted(runner.model) as counted:
        driver.extend({0: ids[:cut]}, mm_inputs={0: images})
        logits = driver.extend({0: ids[cut:]}, mm_inputs={0: images})[0]
    assert counted.calls == [1]  # the second pass took the cached features
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


@pytest.mark.parametrize("grid, tokens, message", [
    ((3, 2), 9, "6 image tokens; its features are 8 rows"),  # the features' count
    ((2, 4), 12, "a 2 x 4 grid spans 10 tokens, not 12"),  # the span's length
])
def test_a_grid_that_disagrees_is_refused(pair, grid, tokens, message) -> None:
    """(a 2x4 grid image, 10 tokens, taken as another grid or a longer span)"""
    hf_model, runner = pair
    pixels = processed(hf_model, SIZES[:1], seed=8)
    ids, images = prompt_with_images(hf_model, pixels, [3, 3], seed=8)
    assert images[0].grid == (2, 4)
    with pytest.raises(ValueError, match=message):
        wrong = ImageInput(images[0].pixel_values, images[0].offset, tokens, images[0].hash,
                           grid=grid)
        RunnerDriver(runner).extend({0: ids}, mm_inputs={0: [wrong]})


def test_an_earlier_feature_layer_and_projector_biases(monkeypatch, tmp_path) -> None:
    """vision_feature_layer -2 of 2: the tower's first layer's output (the second neither built
    nor loaded); multimodal_projector_bias: linear_1 and linear_2 with biases."""
    config_cls, kwargs = MULTIMODAL_CONFIGS[NAME]
    monkeypatch.setitem(MULTIMODAL_CONFIGS, "mistral3_layer", (config_cls, {
        **kwargs, "vision_feature_layer": -2, "multimodal_projector_bias": True}))
    hf_model = make_checkpoint("mistral3_layer", tmp_path)
    runner = make_runner(tmp_path)
    assert runner.model.vision_tower.feature_layers == [1]
    assert len(runner.model.vision_tower.transformer.layers) == 1
    check_features(runner.model, hf_model, processed(hf_model, SIZES[:3], seed=9))
    pixels = processed(hf_model, SIZES[:2], seed=10)
    ids, images = prompt_with_images(hf_model, pixels, [2, 4, 3], seed=10)
    logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


def as_module_names(name: str) -> str:
    """transformers' saved layout as its module names (`model.*`, `lm_head.*`)."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    return "model." + name


def test_the_module_name_layout_loads(checkpoint, tmp_path) -> None:
    hf_model, folder = checkpoint
    for item in folder.iterdir():
        if item.name != "model.safetensors":
            (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({as_module_names(n): t for n, t in tensors.items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    runner = make_runner(tmp_path)
    pixels = processed(hf_model, SIZES[2:], seed=11)
    check_features(runner.model, hf_model, pixels)
    ids, images = prompt_with_images(hf_model, pixels, [3, 4, 5], seed=11)
    logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


def test_sides_off_the_grid_are_refused(pair) -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        pair[1].model.encode_images(torch.zeros(1, 3, 24, 32))


def tiny_config(**changes: object) -> ModelConfig:
    _, kwargs = MULTIMODAL_CONFIGS[NAME]
    config = transformers.Mistral3Config(**{**kwargs, **changes},
                                         architectures=["Mistral3ForConditionalGeneration"])
    return ModelConfig(config)


@pytest.mark.parametrize("changes, message", [
    (dict(vision_feature_layer=[-2, -1]), "reads one layer"),
    (dict(vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                             intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                             image_size=32, patch_size=4)), "'siglip_vision_model' vision tower"),
])
def test_unsupported_configurations_are_refused(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        Mistral3ForConditionalGeneration(tiny_config(**changes))
