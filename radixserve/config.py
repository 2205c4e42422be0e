"""ServerArgs (every flag, resolved once) and ModelConfig (what the model looks like)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ServerArgs:
    model_path: str = DEFAULT_MODEL_NAME
    tokenizer_path: str | None = None
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cuda | cpu
    context_length: int | None = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    log_requests: bool = False
    random_seed: int = 0

    # memory
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    cpu_kv_cache_bytes: int = 2 * 1024 * 1024 * 1024
    max_running_requests: int | None = None
    max_queued_requests: int | None = None

    # scheduling
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None  # None: device default; -1 disables
    enable_mixed_chunk: bool = False
    schedule_policy: str = "lpm"  # lpm | fcfs | dfs-weight | random
    schedule_conservativeness: float = 1.0
    num_continuous_decode_steps: int = 10
    disable_radix_cache: bool = False
    stream_interval: int = 1

    # GPU path
    attention_backend: str | None = None  # torch_native | triton
    disable_cuda_graph: bool = False
    # decode steps are launched one ahead of reading their ids (scheduler overlap)
    disable_overlap_schedule: bool = False
    cuda_graph_max_bs: int | None = None

    # parallelism (later)
    tp_size: int = 1

    # filled by resolve()
    resolved: bool = field(default=False, repr=False)

    def resolve(self) -> "ServerArgs":
        """Fill device-dependent defaults once; the result is treated as read-only."""
        if self.resolved:
            return self
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        on_gpu = self.device.startswith("cuda")
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = 8192 if on_gpu else 512
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = -1
        if self.attention_backend is None:
            self.attention_backend = "triton" if on_gpu else "torch_native"
        if self.mem_fraction_static is None:
            self.mem_fraction_static = 0.88
        if not on_gpu:
            self.disable_cuda_graph = True
        if self.cuda_graph_max_bs is None:
            # large-memory GPUs (H200: 141 GB) hold 500+ running requests of a few thousand
            # tokens; their decode steps replay graphs too
            big = on_gpu and torch.cuda.is_available() and \
                torch.cuda.get_device_properties(torch.device(self.device)).total_memory > 100e9
            self.cuda_graph_max_bs = 512 if big else 256
        if self.tp_size != 1:
            raise ValueError(f"--tp-size {self.tp_size}: tensor parallelism is not implemented "
                             "yet; only --tp-size 1 runs")
        if self.schedule_policy not in ("lpm", "fcfs", "dfs-weight", "random"):
            raise ValueError(f"unknown --schedule-policy {self.schedule_policy!r}")
        if self.disable_radix_cache and self.schedule_policy in ("lpm", "dfs-weight"):
            self.schedule_policy = "fcfs"  # cache-aware policies need the cache
        self.resolved = True
        return self

    @property
    def chunked_prefill_enabled(self) -> bool:
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            if f.name == "resolved":
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if isinstance(default, bool):
                parser.add_argument(flag, action="store_true", default=default)
                continue
            kind: Any = {"int": int, "float": float}.get(
                str(f.type).replace(" | None", ""), str)
            parser.add_argument(flag, type=kind, default=default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls) if f.name != "resolved"}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


@dataclass
class RopeScaling:
    kind: str = "default"  # default | llama3 | linear
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    mlp_bias: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # attention window of every layer (Mistral v0.1, Qwen2 with use_sliding_window); None: full
    sliding_window: int | None = None
    context_length: int = 0  # resolved: min(user flag, max_position_embeddings, sliding window)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        rs = cfg.get("rope_scaling") or {}
        rope_params = cfg.get("rope_parameters") or {}
        if not rs and rope_params.get("rope_type", "default") != "default":
            rs = rope_params
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        kind = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
        scaling = RopeScaling(
            kind=kind,
            factor=float(rs.get("factor", 1.0)),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        )
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        window = cfg.get("sliding_window")
        if arch.startswith("Qwen2") and not cfg.get("use_sliding_window", False):
            window = None  # Qwen2 configs name a window they do not use
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch.startswith("Qwen2"))),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            torch_dtype=str(dtype).replace("torch.", ""),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=int(window) if window else None,
        )

    @classmethod
    def from_path(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf_dict(json.load(f))

    def resolve_context_length(self, requested: int | None) -> None:
        limit = self.max_position_embeddings
        if self.sliding_window is not None and self.sliding_window < limit:
            # sliding-window attention is not implemented; up to the window, full attention is
            # the same thing, so the context stops there rather than give wrong outputs past it
            logger.warning("%s attends over a sliding window of %d tokens, which radixserve does "
                           "not implement: the context length is capped at %d",
                           self.architecture, self.sliding_window, self.sliding_window)
            limit = self.sliding_window
        self.context_length = min(requested, limit) if requested else limit


def resolve_dtype(name: str, model_dtype: str, device: str) -> torch.dtype:
    """'auto' takes the checkpoint's dtype on GPU; on CPU bf16 checkpoints run in bf16 too."""
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
             "half": torch.float16, "float": torch.float32}
    if name == "auto":
        name = model_dtype if model_dtype in table else "bfloat16"
    if name not in table:
        raise ValueError(f"unknown --dtype {name!r}")
    return table[name]
