"""Gemma-3's images (Gemma3ForConditionalGeneration) against transformers' on tiny random
checkpoints it saved itself (fp32, tests/models/tiny_checkpoints.py "gemma3_multimodal": a
2-layer SigLIP tower over 8x8 patches pooled to 16 tokens an image, five sliding layers of
window 24 and a full one; "gemma3_window12": the same with a window of 12, which an image's 16
tokens do not fit). Prompts run past the window, images between <start_of_image> and
<end_of_image> as Gemma3Processor writes them.

The image features against `get_image_features(...).pooler_output`; the last-token logits of
prompts with images (one image, two, two requests in one pass, an extend on a cached prefix
that ends before the image, an image in each of two passes, decode after an image) against
transformers' forward with token_type_ids (an image's tokens see the whole image), on the CPU
and torch_native backends, which honour `ForwardBatch.extend_causal_limit`. The same prompts
with our side held causal against transformers without token_type_ids (the embedding and
projector path alone); the limits a pass with images sets; each checkpoint layout; an image
id past the vocabulary; the configurations refused."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from radixserve.config import ServerArgs
from radixserve.core.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.core.model_config import ModelConfig
from radixserve.core.multimodal import ImageInput, pixels_hash, vision_spec
from radixserve.executor.model_runner import ModelRunner
from radixserve.models.gemma3 import Gemma3ForConditionalGeneration
from tests.models.runner_driver import RunnerDriver
from tests.models.test_llava import Counted
from tests.models.tiny_checkpoints import MULTIMODAL_CONFIGS, make_checkpoint

NAME = "gemma3_multimodal"
WINDOWS = {NAME: 24, "gemma3_window12": 12}
BOI, EOI, IMAGE = 157, 158, 159  # test_gemma3_multimodal.py's tokenizer's ids
TOKENS = 16  # per image
ATOL = 2e-4

# (our last-token logits, the prompt so far, the pixels of its images)
Case = tuple[torch.Tensor, list[int], list[torch.Tensor]]


def save_checkpoint(name: str, folder: Path, **changes: object) -> torch.nn.Module:
    """make_checkpoint of NAME's config with the window WINDOWS[name] (default NAME's) and
    top-level changes, saved under `name`."""
    config_cls, kwargs = MULTIMODAL_CONFIGS[NAME]
    text = {**kwargs["text_config"], "sliding_window": WINDOWS.get(name, WINDOWS[NAME])}
    kwargs = {**kwargs, "text_config": text, **changes}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(MULTIMODAL_CONFIGS, name, (config_cls, kwargs))
        return make_checkpoint(name, folder)


def make_runner(folder: Path, backend: str = "cpu") -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu",
                                  attention_backend=backend, max_total_tokens=4096,
                                  max_running_requests=32))


@pytest.fixture(scope="module", params=list(WINDOWS))
def checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    return save_checkpoint(request.param, folder), folder


@pytest.fixture(scope="module")
def runners(checkpoint) -> dict[str, ModelRunner]:
    """A runner per backend, made when first asked for."""
    return {}


def runner_for(checkpoint, runners: dict[str, ModelRunner], backend: str) -> ModelRunner:
    if backend not in runners:
        runners[backend] = make_runner(checkpoint[1], backend)
    return runners[backend]


@pytest.fixture()
def causal_runner(checkpoint, runners, monkeypatch) -> ModelRunner:
    """The CPU backend's runner with image tokens held causal: the runner sets no attention
    limits for the pass."""
    runner = runner_for(checkpoint, runners, "cpu")
    monkeypatch.setattr(runner, "vision_spec",
                        dataclasses.replace(runner.vision_spec, bidirectional=False))
    return runner


def random_pixels(count: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 32, 32, generator=gen) for _ in range(count)]


def prompt_with_images(pixels: list[torch.Tensor], texts: list[int], seed: int,
                       image_token: int = IMAGE) -> tuple[list[int], list[ImageInput]]:
    """texts[0] text ids, <start_of_image>, an image's tokens, <end_of_image>, texts[1] text
    ids, ... (one more text run than images); the ImageInputs of the image runs."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    images = []
    for i, text_len in enumerate(texts):
        ids += torch.randint(3, BOI, (text_len,), generator=gen).tolist()
        if i < len(pixels):
            ids.append(BOI)
            images.append(ImageInput(pixels[i], len(ids), TOKENS, pixels_hash(pixels[i])))
            ids += [image_token] * TOKENS + [EOI]
    return ids, images


def covered(images: list[ImageInput], start: int, end: int) -> list[ImageInput]:
    """The images whose tokens a pass over prompt positions [start, end) covers (what the
    scheduler hands the model)."""
    return [image for image in images if image.offset < end and image.end > start]


def hf_last_logits(hf_model: torch.nn.Module, ids: list[int], pixels: list[torch.Tensor],
                   bidirectional: bool, image_token: int = IMAGE) -> torch.Tensor:
    """transformers' last-token logits; bidirectional: with the token_type_ids Gemma3Processor
    makes (1 at image tokens), else none (every token causal)."""
    input_ids = torch.tensor([ids])
    extra = {"token_type_ids": (input_ids == image_token).long()} if bidirectional else {}
    with torch.no_grad():
        out = hf_model(input_ids=input_ids,
                       pixel_values=torch.stack(pixels) if pixels else None, **extra)
    return out.logits[0, -1].float()


def hf_image_features(hf_model: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model.model.get_image_features(pixel_values=pixels,
                                                 return_dict=True).pooler_output


# scenarios: each runs prompts with images through the runner, checks what it encoded, and
# returns its cases

def one_image(runner: ModelRunner) -> list[Case]:
    """Text past the window after the image: the last tokens' sliding layers lose it."""
    pixels = random_pixels(1, seed=1)
    ids, images = prompt_with_images(pixels, [7, 30], seed=1)
    with Counted(runner.model) as counted:
        logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    assert counted.calls == [1]
    return [(logits, ids, pixels)]


def two_images(runner: ModelRunner) -> list[Case]:
    """Two images three tokens apart: the second's tokens see the first in the window."""
    pixels = random_pixels(2, seed=2)
    ids, images = prompt_with_images(pixels, [5, 3, 9], seed=2)
    with Counted(runner.model) as counted:
        logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    assert counted.calls == [2]  # both images of the pass encoded together
    return [(logits, ids, pixels)]


def two_requests(runner: ModelRunner) -> list[Case]:
    """One pass: a prompt with one image, a prompt opening with two; the second's second image
    is the first's (encoded once)."""
    pixels = random_pixels(2, seed=3)
    first = prompt_with_images(pixels[:1], [4, 11], seed=3)
    second_pixels = [pixels[1], pixels[0]]
    second = prompt_with_images(second_pixels, [0, 7, 2], seed=4)
    with Counted(runner.model) as counted:
        logits = RunnerDriver(runner).extend({0: first[0], 1: second[0]},
                                             mm_inputs={0: first[1], 1: second[1]})
    assert counted.calls == [2]
    return [(logits[0], first[0], pixels[:1]), (logits[1], second[0], second_pixels)]


def cached_prefix(runner: ModelRunner) -> list[Case]:
    """A first pass of text, then an extend on that prefix holding the image."""
    pixels = random_pixels(1, seed=5)
    ids, images = prompt_with_images(pixels, [20, 12], seed=5)
    cut = images[0].offset - 3
    driver = RunnerDriver(runner)
    driver.extend({0: ids[:cut]})
    logits = driver.extend({0: ids[cut:]}, mm_inputs={0: covered(images, cut, len(ids))})[0]
    return [(logits, ids, pixels)]


def image_in_each_pass(runner: ModelRunner) -> list[Case]:
    """A pass ending past its image (cached for the next pass's tokens to attend to), then one
    holding the second image; each encodes its own."""
    pixels = random_pixels(2, seed=6)
    ids, images = prompt_with_images(pixels, [6, 10, 8], seed=6)
    cut = images[0].end + 5
    driver = RunnerDriver(runner)
    with Counted(runner.model) as counted:
        first = driver.extend({0: ids[:cut]}, mm_inputs={0: covered(images, 0, cut)})[0]
        second = driver.extend({0: ids[cut:]},
                               mm_inputs={0: covered(images, cut, len(ids))})[0]
    assert counted.calls == [1, 1]
    return [(first, ids[:cut], pixels[:1]), (second, ids, pixels)]


def decode_after_image(runner: ModelRunner) -> list[Case]:
    """Decode steps (no images in the pass) over KV the image's pass wrote."""
    pixels = random_pixels(1, seed=7)
    ids, images = prompt_with_images(pixels, [8, 6], seed=7)
    driver = RunnerDriver(runner)
    cases = [(driver.extend({0: ids}, mm_inputs={0: images})[0], ids, pixels)]
    for token in (11, 12, 13):
        ids = ids + [token]
        cases.append((driver.extend({0: [token]})[0], ids, pixels))
    return cases


SCENARIOS: list[Callable[[ModelRunner], list[Case]]] = [
    one_image, two_images, two_requests, cached_prefix, image_in_each_pass, decode_after_image]


def check_cases(hf_model: torch.nn.Module, cases: list[Case], bidirectional: bool,
                window: int) -> None:
    assert max(len(ids) for _, ids, _ in cases) > window
    for logits, ids, pixels in cases:
        torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels, bidirectional),
                                   atol=ATOL, rtol=1e-4)


def window_of(hf_model: torch.nn.Module) -> int:
    return hf_model.config.text_config.sliding_window


def test_vision_spec_counts_the_features(checkpoint, runners) -> None:
    hf_model, _ = checkpoint
    runner = runner_for(checkpoint, runners, "cpu")
    spec = vision_spec(hf_model.config, "Gemma3ForConditionalGeneration")
    assert runner.vision_spec == spec
    assert (spec.image_token_id, spec.marker_token_id, spec.end_token_id) == (IMAGE, BOI, EOI)
    pixels = torch.stack(random_pixels(1, seed=0))
    assert hf_image_features(hf_model, pixels).shape[1] == spec.tokens_per_image == TOKENS


def test_encode_images_equals_transformers(checkpoint, runners) -> None:
    """SigLIP's last_hidden_state (its post_layernorm applied), pooled, normed, projected."""
    hf_model, _ = checkpoint
    model = runner_for(checkpoint, runners, "cpu").model
    pixels = torch.stack(random_pixels(3, seed=8))
    torch.testing.assert_close(model.encode_images(pixels), hf_image_features(hf_model, pixels),
                               atol=1e-5, rtol=1e-5)
    params = [name for name, _ in model.named_parameters()]
    assert "vision_tower.vision_model.post_layernorm.weight" in params
    assert not [name for name in params if ".head." in name]  # the pooling head is skipped


def test_text_only_prompt_runs_as_the_language_model(checkpoint, runners) -> None:
    hf_model, _ = checkpoint
    runner = runner_for(checkpoint, runners, "cpu")
    ids, _ = prompt_with_images([], [40], seed=9)
    logits = RunnerDriver(runner).extend({0: ids})[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, [], bidirectional=False),
                               atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_held_causal_logits_equal_transformers_without_token_type_ids(
        checkpoint, causal_runner, scenario) -> None:
    """The features written over the image tokens' (unscaled) embeddings, every token causal
    on both sides."""
    hf_model, _ = checkpoint
    check_cases(hf_model, scenario(causal_runner), False, window_of(hf_model))


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_logits_with_images_equal_transformers(checkpoint, runners, scenario,
                                               backend) -> None:
    """An image's tokens attend to the whole image (in the sliding layers within the window),
    as transformers' with token_type_ids."""
    hf_model, _ = checkpoint
    runner = runner_for(checkpoint, runners, backend)
    check_cases(hf_model, scenario(runner), True, window_of(hf_model))


def test_a_pass_with_images_sets_the_attention_limits(checkpoint, runners,
                                                      monkeypatch) -> None:
    """Two requests, one on a cached prefix: each image token's limit is its image's last
    token (an index into its request's extend tokens), any other token's its own; a pass
    without images leaves the field None."""
    runner = runner_for(checkpoint, runners, "cpu")
    first_pixels, second_pixels = random_pixels(2, seed=10)
    first, first_images = prompt_with_images([first_pixels], [2, 3], seed=10)
    second, second_images = prompt_with_images([second_pixels], [6, 1], seed=11)
    rows = runner.req_to_token_pool.alloc(2)
    slots = runner.token_to_kv_pool.alloc(len(first) + len(second))
    runner.req_to_token_pool.write(rows[0], 0, slots[:len(first)])
    runner.req_to_token_pool.write(rows[1], 0, slots[len(first):])
    prefix = 4  # the second request's first 4 tokens cached (as if; their KV unused here)
    batch = ModelWorkerBatch(
        ForwardMode.EXTEND, first + second[prefix:], rows, [len(first), len(second)],
        torch.cat([slots[:len(first)], slots[len(first) + prefix:]]),
        extend_seq_lens=[len(first), len(second) - prefix], extend_prefix_lens=[0, prefix],
        mm_inputs=[first_images, second_images])
    fb = runner.prepare_forward(batch)  # the runner sets them, before the backend's metadata
    first_own = list(range(len(first)))
    first_own[3:3 + TOKENS] = [3 + TOKENS - 1] * TOKENS
    second_own = list(range(len(second) - prefix))
    second_own[3:3 + TOKENS] = [3 + TOKENS - 1] * TOKENS
    assert fb.extend_causal_limit is not None
    assert fb.extend_causal_limit.dtype == torch.int32
    assert fb.extend_causal_limit.tolist() == first_own + second_own
    batch = ModelWorkerBatch(ForwardMode.EXTEND, first[:5], rows[:1], [5], slots[:5],
                             extend_seq_lens=[5], extend_prefix_lens=[0])
    fb = runner.prepare_forward(batch)
    runner.model(fb.input_ids, fb.positions, fb)
    assert fb.extend_causal_limit is None


def relaid(names: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """transformers' saved layout (`language_model.model.*`, `vision_tower.embeddings.*`) as
    the hub's (`vision_tower.vision_model.*`) or transformers' module names (`model.*`)."""
    out = {}
    for name, tensor in names.items():
        if layout == "hub" and name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        elif layout == "modules":
            if name.startswith("language_model.model."):
                name = "model.language_model." + name.removeprefix("language_model.model.")
            else:
                name = "model." + name
        out[name] = tensor
    return out


@pytest.mark.parametrize("layout", ["saved", "hub", "modules"])
def test_each_checkpoint_layout_loads(layout, tmp_path_factory) -> None:
    """As transformers 5.25 saves it (`vision_tower.*`, `multi_modal_projector.*`,
    `language_model.model.*`, tied), the hub's, and under transformers' module names."""
    folder = tmp_path_factory.mktemp("saved")
    hf_model = save_checkpoint(NAME, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    assert "vision_tower.post_layernorm.weight" in tensors
    assert "multi_modal_projector.mm_input_projection_weight" in tensors
    if layout != "saved":
        into = tmp_path_factory.mktemp(layout)
        for item in folder.iterdir():
            if item.name != "model.safetensors":
                (into / item.name).write_bytes(item.read_bytes())
        save_file(relaid(tensors, layout), str(into / "model.safetensors"),
                  metadata={"format": "pt"})
        folder = into
    runner = make_runner(folder)
    runner.vision_spec = dataclasses.replace(runner.vision_spec, bidirectional=False)
    pixels = random_pixels(2, seed=12)
    torch.testing.assert_close(runner.model.encode_images(torch.stack(pixels)),
                               hf_image_features(hf_model, torch.stack(pixels)), atol=1e-5,
                               rtol=1e-5)
    ids, images = prompt_with_images(pixels, [3, 4, 5], seed=12)
    logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels, False),
                               atol=ATOL, rtol=1e-4)


def test_an_image_id_past_the_vocabulary(tmp_path) -> None:
    """image_token_index 160 of a 160-token vocabulary (the hub's is 262144 of 262208; some
    configs' lie past it): the placeholder embeds as token 0 before its features replace it."""
    hf_model = save_checkpoint("gemma3_oov_image", tmp_path, image_token_index=160)
    runner = make_runner(tmp_path)
    runner.vision_spec = dataclasses.replace(runner.vision_spec, bidirectional=False)
    assert runner.vision_spec.image_token_id == 160 == runner.model_config.vocab_size
    pixels = random_pixels(1, seed=13)
    ids, images = prompt_with_images(pixels, [5, 6], seed=13, image_token=160)
    logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels, False, 160),
                               atol=ATOL, rtol=1e-4)


def tiny_config(**changes: object) -> ModelConfig:
    _, kwargs = MULTIMODAL_CONFIGS[NAME]
    config = transformers.Gemma3Config(**{**kwargs, **changes},
                                       architectures=["Gemma3ForConditionalGeneration"])
    return ModelConfig(config)


@pytest.mark.parametrize("changes, message", [
    (dict(vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                             intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                             image_size=32, patch_size=4)), "'clip_vision_model' vision tower"),
    (dict(mm_tokens_per_image=8), "not a square grid"),
    (dict(mm_tokens_per_image=9), "not a square grid"),  # 3x3 does not pool 8x8
])
def test_unsupported_configurations_are_refused(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        Gemma3ForConditionalGeneration(tiny_config(**changes))
