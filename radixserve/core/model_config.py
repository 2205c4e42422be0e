"""ModelConfig: what the model looks like, read once from its Hugging Face config (a
config.json-style dict, or a GGUF's metadata mapped to HF names), and the architectures and
rope kinds radixserve serves."""
from __future__ import annotations

import functools
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# architectures radixserve serves -> the transformers model_type of their config
ARCHITECTURE_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    # Mistral Small 3.1 / 3.2: served text-only, its language model (`text_config`)
    "Mistral3ForConditionalGeneration": "mistral3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    # multimodal Gemma-3 (4b-27b): served text-only, its language model (`text_config`)
    "Gemma3ForConditionalGeneration": "gemma3",
    # Qwen2-VL / Qwen2.5-VL: a Qwen2 language model with multimodal rope, and their images
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "GptOssForCausalLM": "gpt_oss",
    "Mistral4ForCausalLM": "mistral4",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    # hybrid linear + full attention; Qwen3.5 ships multimodal (its images are read)
    "OlmoHybridForCausalLM": "olmo_hybrid",
    "NemotronHForCausalLM": "nemotron_h",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "BambaForCausalLM": "bamba",
    "FalconH1ForCausalLM": "falcon_h1",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
# layer-type names of older configs -> transformers 5's
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
# rope scaling kinds implemented (layers/rotary.py computes them with transformers' own
# frequency functions; longrope's two tables and their switch: core/long_rope.py); anything
# else is refused rather than run with the wrong positions
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _architectures_of(model_type: str | None) -> list[str]:
    """A config without `architectures`: the architecture of its model_type (as transformers
    picks the causal-LM class by model_type), Llama where neither says."""
    if model_type is None:
        return ["LlamaForCausalLM"]
    by_type = {kind: arch for arch, kind in ARCHITECTURE_MODEL_TYPES.items()}
    if model_type in by_type:
        return [by_type[model_type]]
    raise ValueError(f"config.json has no architectures and model_type {model_type!r} is "
                     f"none of ours ({', '.join(sorted(by_type))})")


def _json_floats(value: Any) -> Any:
    """transformers writes floats JSON cannot hold (Nemotron-H's time_step_limit of [0,
    inf]) as {"__float__": "Infinity"}; its from_pretrained reads them back, as this does."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in ("Infinity", "-Infinity",
                                                                 "NaN"):
            return float(value["__float__"])
        return {key: _json_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_floats(item) for item in value]
    return value


def hf_config_from_dict(cfg: dict[str, Any]) -> Any:
    """A transformers config object from a config.json-style dict (HF folder or GGUF
    metadata mapped to HF names)."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    cfg = _json_floats(dict(cfg))
    archs = cfg.get("architectures") or _architectures_of(cfg.get("model_type"))
    cfg["architectures"] = archs
    model_type = cfg.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:  # e.g. Kimi-K2's "kimi_k2": DeepSeek-V3's layout
        model_type = ARCHITECTURE_MODEL_TYPES.get(archs[0], model_type)
    if model_type is None:
        return PretrainedConfig(**cfg)
    return AutoConfig.for_model(model_type, **cfg)


class ModelConfig:
    """What the model looks like: the Hugging Face config object (`hf`), plus the few fields
    every layer needs, resolved once (head_dim, KV heads, EOS ids, the context length).

    Model files read anything family-specific straight from `hf` (Gemma-2's soft-capping,
    Qwen3's q/k norms, ...). For a multimodal checkpoint served text-only (Gemma-3 4b-27b:
    `text_config` and `vision_config`) `hf` is its language model's config
    (`get_text_config`, the config itself for every other model); the architecture, EOS and
    BOS ids and dtype are the top level's where it sets them, as transformers reads them for
    the whole model; embedding tying is the language model's own, as vLLM reads it."""

    def __init__(self, hf_config: Any) -> None:
        self.hf = text_config = hf_config.get_text_config(decoder=True)
        self.hf_top = hf_config  # the whole model's config (a multimodal one's vision_config)
        archs = getattr(hf_config, "architectures", None) or \
            _architectures_of(getattr(hf_config, "model_type", None) or None)
        self.architecture: str = archs[0]
        get = functools.partial(getattr, text_config)

        def top(name: str, default: Any = None) -> Any:
            value = getattr(hf_config, name, None)
            return get(name, default) if value is None else value

        self.vocab_size: int = get("vocab_size")
        self.hidden_size: int = get("hidden_size")
        self.intermediate_size: int = get("intermediate_size", 0)
        self.num_hidden_layers: int = get("num_hidden_layers")
        self.num_attention_heads: int = get("num_attention_heads")
        self.num_key_value_heads: int = get("num_key_value_heads", None) or \
            self.num_attention_heads
        self.head_dim: int = get("head_dim", None) or self.hidden_size // self.num_attention_heads
        self.max_position_embeddings: int = get("max_position_embeddings", 4096)
        self.rms_norm_eps: float = get("rms_norm_eps", 1e-6)
        # the language model's own (vLLM's reading): Mistral3Config's top-level default is
        # True where Mistral Small 3.1's language model is untied and its config.json says
        # nothing at the top level
        self.tie_word_embeddings: bool = bool(get("tie_word_embeddings", False))
        if self.architecture.startswith("Qwen3_5") and hf_config is not text_config:
            # Qwen3.5's multimodal configs tie by their top-level flag (transformers saves
            # text_config's as false beside a tied model's true)
            self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Qwen2 (also as a LLaVA's language model): bias on q/k/v
        default_bias = self.architecture.startswith("Qwen2") or \
            getattr(text_config, "model_type", None) == "qwen2"
        self.attention_bias: bool = bool(get("attention_bias", get("qkv_bias", default_bias)))
        # Llama and Qwen3 put attention_bias on o_proj too; Qwen2's and GLM-4.5's q/k/v bias
        # stops there
        self.o_proj_bias: bool = self.attention_bias and not default_bias and \
            not self.architecture.startswith("Glm4Moe")
        self.mlp_bias: bool = bool(get("mlp_bias", False))
        dtype = top("dtype") or "bfloat16"
        self.torch_dtype: str = str(dtype).replace("torch.", "")
        self.bos_token_id: int | None = top("bos_token_id")
        eos = top("eos_token_id")
        self.eos_token_ids: list[int] = [] if eos is None else \
            ([eos] if isinstance(eos, int) else list(eos))
        window = get("sliding_window", None)
        if default_bias and not get("use_sliding_window", False):
            window = None  # Qwen2 configs name a window they do not use
        self.sliding_window: int | None = int(window) if window else None
        # older configs (Granite-4.0-H's, Bamba's) and transformers releases before the
        # rename say "mamba" / "attention": read as transformers 5's names
        self.layer_types: list[str] | None = None if get("layer_types", None) is None else \
            [_LEGACY_LAYER_TYPES.get(t, t) for t in get("layer_types")]
        self.rope_parameters: dict[str, Any] = dict(get("rope_parameters", None) or {})
        # a rope per layer type, where transformers keys rope_parameters by layer type
        # (Gemma-3: a local base on sliding layers, scaling on full ones; its rope_parameters
        # and rope_type then say nothing of either); empty otherwise
        self.layer_rope_parameters: dict[str, dict[str, Any]] = {
            kind: dict(params) for kind, params in self.rope_parameters.items()
            if kind in (self.layer_types or ()) and isinstance(params, dict)}
        self.context_length = 0  # resolve_context_length: min(user flag, max positions)
        self._check_rope()

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", self.rope_parameters.get("type", "default"))

    def _check_rope(self) -> None:
        kinds = [self.rope_type] + [params.get("rope_type", params.get("type", "default"))
                                    for params in self.layer_rope_parameters.values()]
        for kind in kinds:
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"{self.architecture}: rope scaling {kind!r} is not "
                                 f"supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if "longrope" in kinds[1:]:  # one rope for every layer only (core/long_rope.py)
            raise ValueError(f"{self.architecture}: rope scaling 'longrope' per layer type is "
                             "not supported")

    def layer_sliding_window(self, layer_id: int) -> int | None:
        """The attention window of one layer (None: full attention). Mistral v0.1 windows every
        layer; Gemma-2 and Qwen2 name the sliding layers in `layer_types`."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer_id] != "sliding_attention":
            return None
        return self.sliding_window if self.sliding_window < self.max_position_embeddings \
            else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """ValueError for a config transformers refuses (a field of the wrong type) or whose
        sizes are not positive."""
        try:
            hf_config = hf_config_from_dict(cfg)
            text = hf_config.get_text_config(decoder=True)
            for name in _POSITIVE_SIZES:  # as written, before anything is derived from them
                _check_positive(name, getattr(text, name, None), missing_ok=True)
            config = cls(hf_config)
        except ValueError:
            raise
        except Exception as exc:  # e.g. huggingface_hub's StrictDataclassFieldValidationError
            raise ValueError(f"the model config is invalid: {exc}") from None
        for name in _POSITIVE_SIZES:
            _check_positive(name, getattr(config, name), missing_ok=False)
        return config

    @classmethod
    def from_path(cls, path: str) -> "ModelConfig":
        from transformers import AutoConfig
        return cls(AutoConfig.from_pretrained(path))

    def resolve_context_length(self, requested: int | None) -> None:
        """--context-length, at most the model's max_position_embeddings: a longer one is
        refused (as vLLM and SGLang do) unless RADIXSERVE_ALLOW_LONGER_CONTEXT=1 allows
        positions the model was not trained on. Without the flag, the model's positions up to
        DEFAULT_CONTEXT_CAP (Llama-4 Scout allows 10M, whose request table and rope tables
        alone would take ~20 GB; a longer context is asked for by the flag)."""
        limit = self.max_position_embeddings
        if not requested and limit > DEFAULT_CONTEXT_CAP:
            logger.info("%s allows %d positions; serving a context of %d "
                        "(--context-length for another)", self.architecture, limit,
                        DEFAULT_CONTEXT_CAP)
            self.context_length = DEFAULT_CONTEXT_CAP
            return
        if requested and requested > limit:
            if os.environ.get("RADIXSERVE_ALLOW_LONGER_CONTEXT") != "1":
                raise ValueError(f"--context-length {requested} exceeds the model's "
                                 f"max_position_embeddings ({limit}); set "
                                 "RADIXSERVE_ALLOW_LONGER_CONTEXT=1 to serve positions past "
                                 "those it was trained on")
            logger.warning("--context-length %d exceeds the model's max_position_embeddings "
                           "(%d): RADIXSERVE_ALLOW_LONGER_CONTEXT=1 allows it", requested, limit)
        self.context_length = requested or limit

    @property
    def rope_positions(self) -> int:
        """Positions the rope tables cover: the model's (at most DEFAULT_CONTEXT_CAP), or the
        context where it is longer (asked for, or let past the model's by
        RADIXSERVE_ALLOW_LONGER_CONTEXT)."""
        return max(min(self.max_position_embeddings, DEFAULT_CONTEXT_CAP), self.context_length)


# the context of a model allowing more positions, unless --context-length asks for another
DEFAULT_CONTEXT_CAP = 1 << 20


_POSITIVE_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim")


def _check_positive(name: str, value: Any, missing_ok: bool) -> None:
    if value is None and missing_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"the model config's {name} is {value!r}; it must be a positive "
                         "integer")
