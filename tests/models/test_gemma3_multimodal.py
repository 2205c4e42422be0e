"""Multimodal Gemma-3 checkpoints (Gemma3ForConditionalGeneration: gemma-3-4b/12b/27b) on text,
against transformers' Gemma3ForConditionalGeneration on a tiny random checkpoint it saved
itself (tests/models/tiny_checkpoints.py "gemma3_multimodal", fp32): the config's language
model and top-level ids, each checkpoint layout loaded (its vision tensors too), greedy
generation through the Engine (prompts longer than the sliding window), a stop at the top
level's EOS id, and, from a folder without an image processor, the model served text-only
with images refused where a request could carry them (test_gemma3_serving.py: with images)."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import radixserve
from radixserve.config import ServerArgs
from radixserve.core.model_config import ModelConfig
from radixserve.core.sampling_params import InvalidRequestError
from radixserve.executor.model_runner import ModelRunner
from radixserve.models.registry import get_model_class
from radixserve.server.errors import APIError
from radixserve.server.openai_protocol import ChatCompletionRequest, parse_model
from tests.models.test_gemma3_vs_hf import ATOL, hf_logits, prefill_logits
from tests.models.test_greedy_vs_hf import hf_greedy
from tests.models.tiny_checkpoints import MULTIMODAL_CONFIGS, make_checkpoint

NAME = "gemma3_multimodal"
NEW_TOKENS = 40
VOCAB = 160
WINDOW = 24  # the tiny text_config's sliding_window
EOS = [1, 106]  # config.json's top level; its text_config says 1 (the default)
VISION = ("vision_tower.", "multi_modal_projector.")

# google/gemma-3-4b-it's config.json (vision_config abridged): the language model's fields in
# text_config, the EOS ids and dtype at the top level only
HUB_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}

# a Gemma-3-like chat template: an image part becomes <start_of_image>, with no image behind it
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn> "
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for item in m['content'] %}{% if item['type'] == 'image' %}<start_of_image> "
    "{% elif item['type'] == 'text' %}{{ item['text'] }} {% endif %}{% endfor %}{% endif %}"
    " <end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn> model {% endif %}")
SPECIAL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "user", 5: "model",
           105: "<start_of_turn>", 106: "<end_of_turn>", 157: "<start_of_image>",
           158: "<end_of_image>", 159: "<image_soft_token>"}


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of the tiny vocabulary ("w7" is id 7) with Gemma-3's special
    tokens at small ids and CHAT_TEMPLATE, saved beside the checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {SPECIAL.get(i, f"w{i}"): i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>",
                                        eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                        additional_special_tokens=[
                                            SPECIAL[i] for i in (105, 106, 157, 158, 159)])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp(NAME)
    hf_model = make_checkpoint(NAME, folder)
    write_tokenizer(folder)
    return hf_model, folder


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = radixserve.Engine(str(checkpoint[1]), dtype="float32", max_total_tokens=4096,
                            chunked_prefill_size=48)
    yield eng
    eng.shutdown()


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    """Random text: any id but the image token (159), which only an image's run may hold."""
    gen = torch.Generator().manual_seed(seed)
    return [[t if t != 159 else 158 for t in torch.randint(0, VOCAB, (n,), generator=gen)
             .tolist()] for n in lengths]


def test_config_is_the_language_models_with_the_top_levels_ids() -> None:
    config = ModelConfig.from_hf_dict(HUB_4B_CONFIG)
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert type(config.hf).__name__ == "Gemma3TextConfig"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (262208, 2560,
                                                                                  34)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4,
                                                                                          256)
    assert config.max_position_embeddings == 131072 and config.sliding_window == 1024
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config.layer_rope_parameters["full_attention"]["rope_type"] == "linear"
    assert config.layer_rope_parameters["full_attention"]["factor"] == 8.0
    assert config.layer_rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.hf.eos_token_id == 1  # what reading the text config alone would stop on
    assert config.eos_token_ids == EOS and config.bos_token_id == 2
    assert config.tie_word_embeddings and config.torch_dtype == "bfloat16"
    assert get_model_class(config.architecture).__name__ == "Gemma3ForConditionalGeneration"
    # a config.json without architectures: its model_type's, as transformers picks it
    bare = {k: v for k, v in HUB_4B_CONFIG.items() if k != "architectures"}
    assert ModelConfig.from_hf_dict(bare).architecture == "Gemma3ForConditionalGeneration"
    config.resolve_context_length(None)
    assert config.context_length == 131072


def transformers_module_names(folder: Path, into: Path) -> None:
    """The checkpoint at `folder` with its tensors under transformers' module names
    (model.language_model.*, model.vision_tower.*, lm_head.weight), as some fine-tunes are
    saved."""
    renames = {"language_model.model.": "model.language_model.",
               "language_model.lm_head.": "lm_head.", "vision_tower.": "model.vision_tower.",
               "multi_modal_projector.": "model.multi_modal_projector."}
    shutil.copy(folder / "config.json", into / "config.json")
    tensors = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        old = next(prefix for prefix in renames if name.startswith(prefix))
        tensors[renames[old] + name[len(old):]] = tensor
    save_file(tensors, str(into / "model.safetensors"))


@pytest.mark.parametrize("layout", ["saved", "untied", "module_names"])
def test_each_checkpoint_layout_loads_the_language_model_alone(layout: str, tmp_path,
                                                               monkeypatch) -> None:
    """As transformers saves it (language_model.model.*, vision_tower.*, a tied head), untied
    (language_model.lm_head.weight), and under transformers' module names (model.language_model.*,
    model.vision_tower.*, lm_head.weight): the vision tensors are in the checkpoint, none in the
    model, and every prefill position's logits are transformers'."""
    name = NAME
    if layout != "saved":
        config_cls, kwargs = MULTIMODAL_CONFIGS[NAME]
        name = f"{NAME}_untied"
        monkeypatch.setitem(MULTIMODAL_CONFIGS, name, (config_cls, {
            **kwargs, "tie_word_embeddings": False,
            "text_config": {**kwargs["text_config"], "tie_word_embeddings": False}}))
    folder = tmp_path / "saved"
    hf_model = make_checkpoint(name, folder)
    if layout == "module_names":
        folder = tmp_path / "module_names"
        folder.mkdir()
        transformers_module_names(tmp_path / "saved", folder)
    names = list(load_file(str(folder / "model.safetensors")))
    head = {"saved": [], "untied": ["language_model.lm_head.weight"],
            "module_names": ["lm_head.weight"]}[layout]
    assert [n for n in names if "lm_head" in n] == head
    prefix = "model." if layout == "module_names" else ""
    assert all(any(n.startswith(prefix + p) for n in names) for p in VISION)
    runner = ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu",
                                    max_total_tokens=4096, max_running_requests=8))
    assert type(runner.model).__name__ == "Gemma3ForConditionalGeneration"
    assert runner.model_config.tie_word_embeddings == (layout == "saved")
    params = [n for n, _ in runner.model.named_parameters()]
    assert "multi_modal_projector.mm_input_projection_weight" in params  # loaded: tested in
    # test_gemma3_images.py
    assert ("lm_head.weight" in params) == (layout != "saved")
    prompts = random_prompts((13, 70, 130), seed=1)
    for ours, ids in zip(prefill_logits(runner, prompts), prompts):
        torch.testing.assert_close(ours, hf_logits(hf_model, ids), atol=ATOL, rtol=1e-4)


def test_greedy_generation_equals_transformers(checkpoint, engine) -> None:
    """Prompts past the sliding window, one sharing another's first 50 tokens (served from
    the radix cache), chunked prefill of 48 tokens; transformers' full forward argmax'ed one
    token at a time is the reference (test_greedy_vs_hf.py says why not `generate`)."""
    hf_model, _ = checkpoint
    prompts = random_prompts((70, 101), seed=7)
    assert min(map(len, prompts)) > WINDOW
    prompts.append(prompts[0][:50] + random_prompts((25,), seed=8)[0])
    expected = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    first = engine.generate(input_ids=prompts[0], sampling_params=params)
    rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
    assert [first["output_ids"]] + [r["output_ids"] for r in rest] == expected
    assert rest[1]["meta_info"]["cached_tokens"] >= 48
    info = engine.scheduler.model_info
    assert info["eos_token_ids"] == EOS and info["context_len"] == 512
    state = engine.get_internal_state()
    assert state["memory_check_ok"] and state["leaked_tokens"] == 0


def test_generation_stops_at_the_top_levels_eos_id(checkpoint, tmp_path) -> None:
    """A copy of the checkpoint whose embedding rows of token g (tied: its LM head row too)
    and 106 are swapped: where the original's greedy answer first says g, the copy says 106,
    which config.json names an EOS id only at its top level. generation_config.json (which
    names it too) is removed, so the stop comes from config.json alone."""
    hf_model, _ = checkpoint
    prompt = [t for t in random_prompts((60,), seed=11)[0] if t not in EOS]
    answer = hf_greedy(hf_model, prompt, NEW_TOKENS)
    k = next(i for i, g in enumerate(answer)
             if g not in prompt + answer[:i] + EOS and not set(EOS) & set(answer[:i]))
    swapped = copy.deepcopy(hf_model)
    embed = swapped.model.language_model.embed_tokens.weight
    with torch.no_grad():
        embed[[answer[k], 106]] = embed[[106, answer[k]]].clone()
    assert hf_greedy(swapped, prompt, k + 1) == answer[:k] + [106]
    swapped.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["eos_token_id"] == 1
    engine = radixserve.Engine(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                               max_total_tokens=2000)
    try:
        out = engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 0})
        assert out["output_ids"] == answer[:k] + [106]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 106}
    finally:
        engine.shutdown()


def test_chat_renders_text_and_refuses_images(engine) -> None:
    """Engine.chat renders text-only turns with the checkpoint's own template; an image part
    (which Gemma-3's template would write as a bare <start_of_image>) is refused, as the
    server's chat route refuses it."""
    tokenizer = engine.tokenizer
    turns = [{"role": "user", "content": [{"type": "text", "text": "w10 w11 w12"}]}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(turns, tokenize=False,
                                                         add_generation_prompt=True),
                           add_special_tokens=False)
    assert ids[:4] == [2, 105, 4, 10] and ids[-2:] == [105, 5]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    expected = engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
    assert engine.chat(turns, params)["output_ids"] == expected
    for part in ({"type": "image"}, {"type": "image_url", "image_url": {"url": "x.png"}}):
        image_turns = [{"role": "user", "content": [part, {"type": "text", "text": "w10"}]}]
        with pytest.raises(InvalidRequestError, match=f"type {part['type']!r}"):
            engine.chat(image_turns, params)
        with pytest.raises(InvalidRequestError, match="reads no images"):
            engine.chat([turns, image_turns], params)


@pytest.mark.parametrize("part,match", [
    ({"type": "image_url", "image_url": {"url": "x.png"}}, "reads no images"),
    ({"type": "image", "url": "x.png"}, "type 'image' are not supported"),
    ({"type": "input_image", "image_url": "x.png"}, "type 'input_image' are not supported")])
def test_the_server_answers_an_image_400(part: dict, match: str) -> None:
    """The chat route (and /tokenize's messages) read content parts through ChatMessage:
    without the model's image rendering an image_url part is a 400 saying the model reads no
    images, and a part of an unknown type a 400 naming it."""
    body = parse_model(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]})
    body.check_unsupported()
    with pytest.raises(APIError, match=match) as info:
        body.conversation()
    assert info.value.status_code == 400 and info.value.param == "messages"


def test_a_missing_tensor_is_named_as_the_checkpoint_names_it(checkpoint, tmp_path) -> None:
    from radixserve.loader.checkpoint_error import CheckpointError
    _, folder = checkpoint
    tensors = load_file(str(folder / "model.safetensors"))
    dropped = "language_model.model.layers.1.mlp.down_proj.weight"
    assert dropped in tensors
    del tensors[dropped]
    shutil.copytree(folder, tmp_path / "cut")
    save_file(tensors, str(tmp_path / "cut" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=dropped.replace(".", r"\.")):
        ModelRunner(ServerArgs(model_path=str(tmp_path / "cut"), dtype="float32", device="cpu",
                               max_total_tokens=256))
