"""Qwen2-VL and Qwen2.5-VL images against transformers on tiny random checkpoints it saved itself
(fp32, tests/models/tiny_checkpoints.py "qwen2_vl" / "qwen2_5_vl", tests/models/qwen_vl_folder.py:
4x4 patches merged 2x2, Qwen2.5-VL's windows 2x2 image tokens a side, so grids that are not
whole windows leave short ones).

The towers' features against `get_image_features`; multimodal rope: `mrope_positions` over a
prompt cut into two passes at every point (each pass's offset from `Req.rope_shift`) against
transformers' `get_rope_index`, and the decode position (its index plus the images' deltas)
against its rope deltas; logits through a ModelRunner against transformers' forward with its
own 3-D positions: text only, one image, two images, a prompt cut inside an image then decoded
token by token (the decode passes plain rope at shifted 1-D positions), two requests of one
pass; the hub's checkpoint layout (`visual.*`, `model.*`)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from radixserve.config import ServerArgs
from radixserve.core.multimodal import ImageInput, mrope_positions, pixels_hash
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.executor.model_runner import ModelRunner
from tests.models.qwen_vl_folder import (IMAGE_PAD, VISION_END, VISION_START,
                                         hf_image_features, hf_logits, hf_positions,
                                         image_processor, write_qwen_vl_folder)
from tests.models.runner_driver import RunnerDriver

DEVICE = os.environ.get("RADIXSERVE_TEST_DEVICE", "cpu")
NAMES = ["qwen2_5_vl", "qwen2_vl", "qwen3_5_vl", "qwen3_vl", "qwen3_vl_moe"]
# fp32 on the CPU; the GPU's kernels reduce in other orders (RADIXSERVE_TEST_DEVICE=cuda)
ATOL = 2e-5 if DEVICE == "cpu" else 2e-3
# (height, width): processed to patch grids 8x12, 12x10, 10x10 (5x5 image tokens: windows
# of 2, 2 and 1), 4x16
SIZES = [(30, 50), (45, 37), (40, 40), (17, 61)]


def make_runner(folder: Path) -> ModelRunner:
    """On RADIXSERVE_TEST_DEVICE (cuda: the GPU's backend and kernels; default the CPU)."""
    return ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device=DEVICE,
                                  max_total_tokens=4096, max_running_requests=8))


@pytest.fixture(scope="module", params=NAMES)
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, ModelRunner, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = write_qwen_vl_folder(folder, request.param)
    return hf_model, make_runner(folder), folder


def images_of(sizes: list[tuple[int, int]], seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


class Prompt:
    """Random text runs with one image between each two (`texts` one longer than `sizes`):
    the expanded ids, the ImageInputs, and the processor's output for transformers."""

    def __init__(self, sizes: list[tuple[int, int]], texts: list[int], seed: int) -> None:
        self.pixels = image_processor()(images=images_of(sizes, seed), return_tensors="pt") \
            if sizes else None
        gen = torch.Generator().manual_seed(seed)
        grids = [] if self.pixels is None else self.pixels["image_grid_thw"].tolist()
        rows = [] if self.pixels is None else \
            torch.split(self.pixels["pixel_values"], [t * h * w for t, h, w in grids])
        ids: list[int] = []
        self.images: list[ImageInput] = []
        for i, text_len in enumerate(texts):
            ids += torch.randint(6, VIDEO_LIMIT, (text_len,), generator=gen).tolist()
            if i < len(grids):
                t, h, w = grids[i]
                ids.append(VISION_START)
                own = rows[i].clone()
                self.images.append(ImageInput(own, len(ids), t * h * w // 4, pixels_hash(own),
                                              thw=(t, h // 2, w // 2)))
                ids += [IMAGE_PAD] * (t * h * w // 4)
                ids.append(VISION_END)
        self.ids = ids

    def shift(self, start: int) -> int:
        req = Req("r", self.ids, SamplingParams(), mm_inputs=self.images)
        return req.rope_shift(start)

    def within(self, start: int, end: int) -> list[ImageInput]:
        return [image for image in self.images if image.offset < end and image.end > start]


VIDEO_LIMIT = 156  # text ids stay below the vision tokens


def test_towers_equal_transformers(pair) -> None:
    hf_model, runner, _ = pair
    for seed, size in enumerate(SIZES):
        prompt = Prompt([size], [1, 1], seed)
        with torch.no_grad():
            features, deepstack = hf_image_features(hf_model, prompt.pixels)
        want = torch.cat([features, *deepstack], dim=-1)  # Qwen3-VL's DeepStack rows after
        got = runner.model.encode_group(prompt.images)[0]
        torch.testing.assert_close(got.cpu(), want, atol=ATOL / 2, rtol=1e-4)


def test_images_of_one_grid_encode_together(pair) -> None:
    _, runner, _ = pair
    first, second = Prompt([(30, 50)], [1, 1], 5).images[0], \
        Prompt([(31, 49)], [1, 1], 6).images[0]
    assert first.thw == second.thw and first.hash != second.hash
    together = runner.model.encode_group([first, second])
    torch.testing.assert_close(together[1], runner.model.encode_group([second])[0],
                               atol=ATOL / 2, rtol=1e-4)


def test_mrope_positions_equal_get_rope_index(pair) -> None:
    """Every cut of a two-image prompt into two passes gives transformers' positions, and
    the first decode position is its length plus transformers' rope delta."""
    hf_model = pair[0]
    prompt = Prompt(SIZES[:2], [3, 2, 4], seed=7)
    want = hf_positions(hf_model, prompt.ids, prompt.pixels["image_grid_thw"])[:, 0]
    length = len(prompt.ids)
    for cut in range(1, length):
        got = torch.cat([mrope_positions([prompt.within(start, end)], [start], [end - start],
                                         [prompt.shift(start)])
                         for start, end in ((0, cut), (cut, length))], dim=1)
        assert torch.equal(got, want), cut
    assert length + prompt.shift(length) == int(want.max()) + 1


def test_text_only_prompt_runs_as_the_language_model(pair) -> None:
    hf_model, runner, _ = pair
    prompt = Prompt([], [37], seed=2)
    logits = RunnerDriver(runner).extend({0: prompt.ids})[0]
    torch.testing.assert_close(logits.cpu(), hf_logits(hf_model, prompt.ids, None)[-1],
                               atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("sizes", [SIZES[:1], SIZES[1:3]])
def test_prompt_with_images(pair, sizes) -> None:
    hf_model, runner, _ = pair
    prompt = Prompt(sizes, [5] + [3] * len(sizes), seed=3)
    logits = RunnerDriver(runner).extend({0: prompt.ids}, mm_inputs={0: prompt.images})[0]
    torch.testing.assert_close(logits.cpu(), hf_logits(hf_model, prompt.ids, prompt.pixels)[-1],
                               atol=ATOL, rtol=1e-4)


def test_prompt_cut_inside_an_image_then_decoded(pair) -> None:
    """Two passes, the cut inside the second image, then four decode steps: each step's
    logits are transformers' over the whole sequence so far."""
    hf_model, runner, _ = pair
    prompt = Prompt(SIZES[:2], [4, 3, 2], seed=4)
    second = prompt.images[1]
    cut = second.offset + second.num_tokens // 2
    driver = RunnerDriver(runner)
    driver.extend({0: prompt.ids[:cut]}, mm_inputs={0: prompt.within(0, cut)},
                  position_offsets={0: prompt.shift(0)})
    ids = list(prompt.ids)
    logits = driver.extend({0: ids[cut:]}, mm_inputs={0: prompt.within(cut, len(ids))},
                           position_offsets={0: prompt.shift(cut)})[0]
    for step in range(4):
        want = hf_logits(hf_model, ids, prompt.pixels)[-1]
        torch.testing.assert_close(logits.cpu(), want, atol=ATOL, rtol=1e-4)
        ids.append(int(want.argmax()) if step % 2 else 6 + step)  # text tokens either way
        logits = driver.extend({0: ids[-1:]}, position_offsets={0: prompt.shift(len(ids))})[0]
    assert prompt.shift(len(ids)) < 0  # the decode positions did trail their indices


def test_requests_with_and_without_images_in_one_pass(pair) -> None:
    hf_model, runner, _ = pair
    with_image = Prompt(SIZES[3:], [2, 5], seed=8)
    text = Prompt([], [9], seed=9)
    logits = RunnerDriver(runner).extend({0: text.ids, 1: with_image.ids},
                                         mm_inputs={1: with_image.images})
    torch.testing.assert_close(logits[0].cpu(), hf_logits(hf_model, text.ids, None)[-1],
                               atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[1].cpu(), hf_logits(hf_model, with_image.ids,
                                                    with_image.pixels)[-1],
                               atol=ATOL, rtol=1e-4)


def test_hub_layout_loads(pair, tmp_path) -> None:
    """The hub's names (`visual.*`, the language model under `model.`; Qwen3-VL-MoE's expert
    stacks [E, H, 2I] and [E, I, H], transposed from transformers 5's) load the same model."""
    hf_model, _, folder = pair
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {name.replace("model.language_model.", "model.").replace("model.visual.",
                                                                       "visual."):
               tensor.transpose(1, 2).contiguous() if ".experts." in name else tensor
               for name, tensor in tensors.items()}
    assert any(name.startswith("visual.blocks.") for name in renamed)
    for path in folder.iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hub = make_runner(tmp_path)
    params = dict(hub.model.named_parameters())
    for name, tensor in renamed.items():
        if name.startswith("visual."):  # the tower's, loaded whole under its own names
            torch.testing.assert_close(params[name].cpu(), tensor, atol=0, rtol=0)
    prompt = Prompt(SIZES[:1], [2, 2], seed=10)
    logits = RunnerDriver(hub).extend({0: prompt.ids}, mm_inputs={0: prompt.images})[0]
    torch.testing.assert_close(logits.cpu(), hf_logits(hf_model, prompt.ids, prompt.pixels)[-1],
                               atol=ATOL, rtol=1e-4)
