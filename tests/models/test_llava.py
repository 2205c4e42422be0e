"""LLaVA-style checkpoints (LlavaForConditionalGeneration) with images, against transformers'
LlavaForConditionalGeneration on tiny random checkpoints it saved itself (fp32,
tests/models/tiny_checkpoints.py "llava": CLIP tower, Llama decoder, "default" strategy, feature
layer -2; "llava_siglip": SigLIP tower, Qwen2 decoder, "full", layer -1): the image features,
the last-token logits of prompts with images through a ModelRunner (one pass, a prompt cut
inside an image's placeholders over two passes that encode it once, two requests with
different images in one pass), the embedding pass, the cache of encoded images, several feature
layers, each checkpoint layout, the placeholder count of vision_spec, and the configurations
refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from radixserve.config import ServerArgs
from radixserve.core.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.core.model_config import ModelConfig
from radixserve.core.multimodal import ImageInput, pixels_hash, vision_spec
from radixserve.executor.model_runner import ModelRunner
from radixserve.models.image_features import ENCODE_BATCH
from radixserve.models.llava import CACHED_IMAGES, LlavaForConditionalGeneration
from tests.models.runner_driver import RunnerDriver
from tests.models.tiny_checkpoints import MULTIMODAL_CONFIGS, make_checkpoint

CASES = ["llava", "llava_siglip"]
ATOL = 2e-5


@pytest.fixture(scope="module", params=CASES)
def checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    return make_checkpoint(request.param, folder), folder


def make_runner(folder: Path) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu",
                                  max_total_tokens=2048, max_running_requests=8))


@pytest.fixture(scope="module")
def pair(checkpoint) -> tuple[torch.nn.Module, ModelRunner]:
    hf_model, folder = checkpoint
    return hf_model, make_runner(folder)


class Counted:
    """Wraps the model's encode_images, recording the batch size of each call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.original, self.calls = model, model.encode_images, []

    def __enter__(self) -> "Counted":
        def counted(pixel_values: torch.Tensor) -> torch.Tensor:
            self.calls.append(pixel_values.shape[0])
            return self.original(pixel_values)
        self.model.encode_images = counted  # type: ignore[method-assign]
        self.model.image_cache.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model.encode_images


def random_pixels(hf_model: torch.nn.Module, count: int, seed: int) -> list[torch.Tensor]:
    size = hf_model.config.vision_config.image_size
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, size, size, generator=gen) for _ in range(count)]


def tokens_per_image(hf_model: torch.nn.Module) -> int:
    spec = vision_spec(hf_model.config, "LlavaForConditionalGeneration")
    assert spec is not None
    return spec.tokens_per_image


def prompt_with_images(hf_model: torch.nn.Module, pixels: list[torch.Tensor], texts: list[int],
                       seed: int) -> tuple[list[int], list[ImageInput]]:
    """texts[0] text ids, an image's placeholders, texts[1] text ids, ... (one more text run
    than images); the ImageInputs of the placeholder runs."""
    gen = torch.Generator().manual_seed(seed)
    image_token, count = hf_model.config.image_token_id, tokens_per_image(hf_model)
    ids: list[int] = []
    images = []
    for i, text_len in enumerate(texts):
        ids += torch.randint(0, image_token, (text_len,), generator=gen).tolist()
        if i < len(pixels):
            images.append(ImageInput(pixels[i], len(ids), count, pixels_hash(pixels[i])))
            ids += [image_token] * count
    return ids, images


def hf_last_logits(hf_model: torch.nn.Module, ids: list[int],
                   pixels: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([ids]),
                       pixel_values=torch.stack(pixels) if pixels else None)
    return out.logits[0, -1].float()


def hf_image_features(hf_model: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = hf_model.model.get_image_features(pixel_values=pixels, return_dict=True)
    return torch.stack(list(out.pooler_output))


def test_vision_spec_counts_the_features(pair) -> None:
    hf_model, runner = pair
    config = hf_model.config
    pixels = torch.stack(random_pixels(hf_model, 1, seed=0))
    assert runner.vision_spec == vision_spec(config, "LlavaForConditionalGeneration")
    assert runner.vision_spec.image_token_id == config.image_token_id
    assert hf_image_features(hf_model, pixels).shape[1] == runner.vision_spec.tokens_per_image


def test_encode_images_equals_transformers(pair) -> None:
    hf_model, runner = pair
    pixels = torch.stack(random_pixels(hf_model, 3, seed=1))
    ours = runner.model.encode_images(pixels)
    torch.testing.assert_close(ours, hf_image_features(hf_model, pixels), atol=1e-5, rtol=1e-5)
    tower = runner.model.vision_tower
    depth = hf_model.config.vision_config.num_hidden_layers
    # "llava" reads layer -2 of 3: the third is neither built nor loaded
    assert len(tower.vision_model.encoder.layers) == depth + 1 + \
        hf_model.config.vision_feature_layer


def test_text_only_prompt_runs_as_the_language_model(pair) -> None:
    hf_model, runner = pair
    ids, _ = prompt_with_images(hf_model, [], [37], seed=2)
    logits = RunnerDriver(runner).extend({0: ids})[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, []), atol=ATOL, rtol=1e-4)


def test_prompt_with_two_images_in_one_pass(pair) -> None:
    hf_model, runner = pair
    pixels = random_pixels(hf_model, 2, seed=3)
    ids, images = prompt_with_images(hf_model, pixels, [5, 3, 9], seed=3)
    with Counted(runner.model) as counted:
        logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    assert counted.calls == [2]  # both images of the pass encoded together
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


def test_prompt_cut_inside_an_image_encodes_it_once(pair) -> None:
    hf_model, runner = pair
    pixels = random_pixels(hf_model, 1, seed=4)
    ids, images = prompt_with_images(hf_model, pixels, [6, 8], seed=4)
    cut = images[0].offset + images[0].num_tokens // 2 + 1
    driver = RunnerDriver(runner)
    with Counted(runner.model) as counted:
        driver.extend({0: ids[:cut]}, mm_inputs={0: images})
        logits = driver.extend({0: ids[cut:]}, mm_inputs={0: images})[0]
    assert counted.calls == [1]  # the second pass took the cached features
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


def test_two_requests_with_different_images_in_one_pass(pair) -> None:
    hf_model, runner = pair
    pixels = random_pixels(hf_model, 3, seed=5)
    first = prompt_with_images(hf_model, pixels[:1], [4, 11], seed=5)
    second = prompt_with_images(hf_model, pixels[1:], [0, 7, 2], seed=6)
    with Counted(runner.model) as counted:
        logits = RunnerDriver(runner).extend({0: first[0], 1: second[0]},
                                             mm_inputs={0: first[1], 1: second[1]})
    assert counted.calls == [3]
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, first[0], pixels[:1]),
                               atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_last_logits(hf_model, second[0], pixels[1:]),
                               atol=ATOL, rtol=1e-4)


def test_embedding_pass_reads_the_images(checkpoint) -> None:
    """--is-embedding: the last position's final hidden state, normalised, images included."""
    hf_model, folder = checkpoint
    runner = ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu",
                                    max_total_tokens=2048, max_running_requests=8,
                                    is_embedding=True))
    pixels = random_pixels(hf_model, 1, seed=8)
    ids, images = prompt_with_images(hf_model, pixels, [4, 5], seed=8)
    row = runner.req_to_token_pool.alloc(1)[0]
    slots = runner.token_to_kv_pool.alloc(len(ids))
    runner.req_to_token_pool.write(row, 0, slots)
    batch = ModelWorkerBatch(ForwardMode.EXTEND, ids, [row], [len(ids)], slots,
                             extend_seq_lens=[len(ids)], extend_prefix_lens=[0],
                             mm_inputs=[images])
    fb = runner.prepare_forward(batch)
    vector = runner.model.embed(fb.input_ids, fb.positions, fb)[0]
    with torch.no_grad():
        hidden = hf_model.model(input_ids=torch.tensor([ids]),
                                pixel_values=torch.stack(pixels)).last_hidden_state[0, -1]
    torch.testing.assert_close(vector, torch.nn.functional.normalize(hidden, dim=-1),
                               atol=1e-5, rtol=1e-5)


def test_the_feature_cache_keeps_the_most_recent_images(pair) -> None:
    hf_model, runner = pair
    model = runner.model
    pixels = random_pixels(hf_model, CACHED_IMAGES + 1, seed=9)
    images = [ImageInput(p, 0, tokens_per_image(hf_model), pixels_hash(p)) for p in pixels]
    with Counted(model) as counted:
        model.image_features(images[:2])
        model.image_features(images[:1])  # a hit: the first image becomes the most recent
        model.image_features(images[2:])
        # the 15 new ones in calls of at most ENCODE_BATCH images
        rest = CACHED_IMAGES - 1
        assert counted.calls == [2] + [min(ENCODE_BATCH, rest - start)
                                       for start in range(0, rest, ENCODE_BATCH)]
        assert len(model.image_cache) == CACHED_IMAGES
        assert images[1].hash not in model.image_cache  # the least recently used went
        assert images[0].hash in model.image_cache


def test_several_feature_layers_concatenate(monkeypatch, tmp_path) -> None:
    """vision_feature_layer as a list: the layers' states side by side (CLIP layers 1 and 3)."""
    config_cls, kwargs = MULTIMODAL_CONFIGS["llava"]
    monkeypatch.setitem(MULTIMODAL_CONFIGS, "llava_layers",
                        (config_cls, {**kwargs, "vision_feature_layer": [-3, -1]}))
    hf_model = make_checkpoint("llava_layers", tmp_path)
    model = make_runner(tmp_path).model
    assert model.vision_tower.feature_layers == [1, 3]
    pixels = torch.stack(random_pixels(hf_model, 2, seed=10))
    torch.testing.assert_close(model.encode_images(pixels), hf_image_features(hf_model, pixels),
                               atol=1e-5, rtol=1e-5)


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
            elif name.startswith("language_model.lm_head."):
                name = name.removeprefix("language_model.")
            else:
                name = "model." + name
        out[name] = tensor
    return out


@pytest.mark.parametrize("layout", ["hub", "modules"])
def test_each_checkpoint_layout_loads(checkpoint, layout, tmp_path) -> None:
    hf_model, folder = checkpoint
    for item in folder.iterdir():
        if item.name != "model.safetensors":
            (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(relaid(tensors, layout), str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    runner = make_runner(tmp_path)
    pixels = random_pixels(hf_model, 2, seed=7)
    torch.testing.assert_close(runner.model.encode_images(torch.stack(pixels)),
                               hf_image_features(hf_model, torch.stack(pixels)), atol=1e-5,
                               rtol=1e-5)
    ids, images = prompt_with_images(hf_model, pixels, [3, 4, 5], seed=7)
    logits = RunnerDriver(runner).extend({0: ids}, mm_inputs={0: images})[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, ids, pixels), atol=ATOL,
                               rtol=1e-4)


def tiny_llava_config(**changes: object) -> ModelConfig:
    _, kwargs = MULTIMODAL_CONFIGS["llava"]
    config = transformers.LlavaConfig(**{**kwargs, **changes},
                                      architectures=["LlavaForConditionalGeneration"])
    return ModelConfig(config)


@pytest.mark.parametrize("changes, message", [
    (dict(text_config=dict(model_type="gemma", vocab_size=300, hidden_size=64,
                           intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                           head_dim=16)), "'gemma' language model"),
    (dict(vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=48,
                             num_hidden_layers=1, num_attention_heads=2, image_size=32,
                             patch_size=8, head_dim=16)),
     "'default' with a Pixtral tower"),  # ("llava"'s strategy: transformers' misreads it)
])
def test_unsupported_parts_are_refused(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        LlavaForConditionalGeneration(tiny_llava_config(**changes))


def test_an_unknown_select_strategy_is_refused() -> None:
    """(transformers' LlavaConfig refuses one too; the model does not count on it)"""
    config = tiny_llava_config()
    object.__setattr__(config.hf_top, "vision_feature_select_strategy", "cls_patch")
    with pytest.raises(ValueError, match="cls_patch"):
        LlavaForConditionalGeneration(config)
