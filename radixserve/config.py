"""ServerArgs: every flag, resolved once (ModelConfig, what the model looks like, is
core/model_config.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from radixserve.core.server_flags import GROUPS, add_flags

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


# images one prompt may carry without --limit-mm-per-prompt (each costs its tower's pass and
# its pixels' memory until the request ends)
DEFAULT_MAX_IMAGES = 64


def _json_value(text: str, flag: str) -> Any:
    """A flag's JSON value; ValueError naming the flag where it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from None


def _json_object(text: str, flag: str, example: str) -> dict[str, Any]:
    """A flag's JSON object; ValueError naming the flag (and an example) for anything else."""
    value = _json_value(text, flag)
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. '{example}'")
    return value


@dataclass
class ServerArgs:
    model_path: str = DEFAULT_MODEL_NAME
    tokenizer_path: str | None = None
    revision: str | None = None  # a hub model's branch, tag or commit (model_path@revision)
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    kv_cache_dtype: str = "auto"  # auto (the compute dtype) | fp8_e4m3 | fp8_e5m2
    quantization: str | None = None  # None (the checkpoint's own, if any) | fp8 | awq | gptq ...
    device: str = "auto"  # auto | cuda | cpu
    context_length: int | None = None
    skip_tokenizer_init: bool = False
    # an embedding model: requests return the last token's final hidden state, L2-normalised
    is_embedding: bool = False
    # LoRA adapters served beside the base model: NAME=PATH or PATH entries (lora_adapters())
    lora_paths: list[str] | None = None
    # adapter slots (loaded at once; more may be loaded at run time up to it); None: as many
    # as --lora-paths; rank and checkpoint modules the slots take (None: --lora-paths')
    enable_lora: bool = False  # vLLM's flag: slots for run-time adapters at its defaults
    max_loras: int | None = None
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    trust_remote_code: bool = False
    # a JSON object whose keys replace the model config's (SGLang's flag), e.g.
    # '{"num_hidden_layers": 5}' for a shape run of a model too large for the device
    json_model_override_args: str | None = None

    host: str = "127.0.0.1"
    port: int = 30000
    max_request_bytes: int = 64 << 20  # larger bodies are answered 413 before being read
    shutdown_timeout: float = 5.0  # seconds running requests get to finish on shutdown
    api_key: str | None = None
    # a folder whose files requests may name as images (file:// URLs, paths); None: none
    allowed_local_media_path: str | None = None
    # vLLM's '{"image": N}': the most images one prompt may carry (max_images_per_prompt)
    limit_mm_per_prompt: str | None = None
    # the only hosts image URLs may name (vLLM's flag); None: any
    allowed_media_domains: list[str] | None = None
    # vLLM's JSON object of overrides for the checkpoint's image processor, e.g. Qwen-VL's
    # '{"max_pixels": 1003520}' (image_processor_overrides)
    mm_processor_kwargs: str | None = None
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
    # native /generate streams: each chunk carries only its new text and ids (SGLang's flag)
    incremental_streaming_output: bool = False

    # scheduling
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None  # None: device default; -1 disables
    enable_mixed_chunk: bool = False
    schedule_policy: str = "lpm"  # lpm | fcfs | dfs-weight | random
    # greedy | cohorts (bursts of known-length requests in whole cohorts, the leftover first)
    admission_plan: str = "greedy"
    schedule_conservativeness: float = 1.0
    # requests' `priority` orders the queue (higher values first unless the flag below) and
    # preempts running requests it outranks by at least the threshold (SGLang's flags)
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    num_continuous_decode_steps: int = 10
    disable_radix_cache: bool = False
    stream_interval: int = 1
    # constrained decoding: append text the grammar forces without a pass per token
    enable_jump_forward: bool = False
    # tool calls on /v1/chat/completions: the model's format; None: from the chat template
    tool_call_parser: str | None = None
    # tool_choice "none": the tools are still rendered for the model unless this is set
    exclude_tools_when_tool_choice_none: bool = False
    # thinking models: the chat route returns <think>...</think> as reasoning_content
    reasoning_parser: str | None = None
    # speculative decoding: None | ngram (drafts from the request's own earlier tokens)
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_ngram_min_match_window_size: int = 2
    speculative_ngram_max_match_window_size: int = 8

    # GPU path
    attention_backend: str | None = None  # cpu | torch_native | triton
    # a different backend for one phase (a hybrid backend); None: --attention-backend
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    disable_cuda_graph: bool = False
    # decode steps are launched one ahead of reading their ids (scheduler overlap)
    disable_overlap_schedule: bool = False
    cuda_graph_max_bs: int | None = None

    # parallelism
    tp_size: int = 1
    # tcp host:port where the tensor-parallel ranks meet; None: a free local port (one node)
    dist_init_addr: str | None = None
    # several machines: the ranks are spread evenly, node n holds ranks
    # [n * tp_size / nnodes, (n + 1) * tp_size / nnodes); node 0 serves HTTP, the others run
    # their ranks headless
    nnodes: int = 1
    node_rank: int = 0
    # seconds the ranks wait for each other to join, and at a collective of the model
    dist_timeout: float = 600.0
    # seconds one scheduler turn may run before the server is taken down (0: never)
    watchdog_timeout: float = 300.0
    # data parallelism: replicas of the model (each --tp-size ranks) behind one server
    dp_size: int = 1
    load_balance_method: str = "round_robin"  # round_robin | shortest_queue | cache_aware
    base_gpu_id: int = 0  # the first GPU this process's ranks use (replica r: r * tp_size)

    # filled by resolve()
    resolved: bool = field(default=False, repr=False)

    def resolve(self) -> "ServerArgs":
        """Fill device-dependent defaults once; the result is treated as read-only."""
        if self.resolved:
            return self
        import torch  # here, not at import: `radixserve --help` must not load torch
        grammar_cache_mb()  # a bad value fails here, once, not at the first grammar
        if self.revision is not None:
            self.model_path = _with_revision(self.model_path, self.revision)
            self.revision = None  # now part of model_path, which every loader resolves
        self.model_overrides()  # a bad value fails here, before any child starts
        self.max_images_per_prompt()
        self.image_processor_overrides()
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        on_gpu = self.device.startswith("cuda")
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = 8192 if on_gpu else 512
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = -1
        if self.attention_backend is None:
            self.attention_backend = "triton" if on_gpu else "cpu"
        self.prefill_attention_backend = self.prefill_attention_backend or self.attention_backend
        self.decode_attention_backend = self.decode_attention_backend or self.attention_backend
        if self.mem_fraction_static is None:
            self.mem_fraction_static = 0.88
        if not on_gpu or self.is_embedding:  # an embedding model runs no decode step
            self.disable_cuda_graph = True
        if self.is_embedding:  # its passes return vectors, read synchronously
            self.disable_overlap_schedule = True
            if self.speculative_algorithm is not None:
                raise ValueError("--speculative-algorithm applies to generation, not to an "
                                 "embedding model (--is-embedding)")
        if self.cuda_graph_max_bs is None:
            # large-memory GPUs (H200: 141 GB) hold 500+ running requests of a few thousand
            # tokens; their decode steps replay graphs too
            big = on_gpu and torch.cuda.is_available() and \
                torch.cuda.get_device_properties(torch.device(self.device)).total_memory > 100e9
            self.cuda_graph_max_bs = 512 if big else 256
        self._check_sizes()
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"unknown --load-balance-method {self.load_balance_method!r}; "
                             f"choose from {', '.join(LOAD_BALANCE_METHODS)}")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ValueError("--dp-size with --nnodes > 1 is not supported: run one server "
                             "per node group, or data parallelism on one node")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not a node of --nnodes "
                             f"{self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} does not spread evenly over "
                             f"--nnodes {self.nnodes}")
        if not self.watchdog_timeout >= 0:
            raise ValueError(f"--watchdog-timeout must be >= 0 seconds, got "
                             f"{self.watchdog_timeout}")
        if self.dist_init_addr is not None:
            split_host_port(self.dist_init_addr)
        if not self.dist_timeout > 0:
            raise ValueError(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address, "
                             "the same on every node)")
        gpus_needed = self.ranks_per_node * self.dp_size
        if on_gpu and gpus_needed > 1 and torch.cuda.is_available() and \
                gpus_needed > torch.cuda.device_count():
            raise ValueError(f"--tp-size {self.tp_size} x --dp-size {self.dp_size} over "
                             f"{self.nnodes} node(s) needs {gpus_needed} GPUs per node; this "
                             f"host has {torch.cuda.device_count()}")
        if self.tp_size > 1 and self.dist_init_addr is None:
            self.dist_init_addr = f"127.0.0.1:{_free_port()}"
        if self.schedule_policy not in ("lpm", "fcfs", "dfs-weight", "random"):
            raise ValueError(f"unknown --schedule-policy {self.schedule_policy!r}")
        if self.admission_plan not in ("greedy", "cohorts"):
            raise ValueError(f"unknown --admission-plan {self.admission_plan!r}")
        if self.speculative_algorithm not in (None, "ngram"):
            raise ValueError(f"unknown --speculative-algorithm {self.speculative_algorithm!r}")
        if self.speculative_ngram_min_match_window_size > \
                self.speculative_ngram_max_match_window_size:
            raise ValueError("--speculative-ngram-min-match-window-size must not exceed "
                             "--speculative-ngram-max-match-window-size")
        self._check_lora()
        if self.disable_radix_cache and self.schedule_policy in ("lpm", "dfs-weight"):
            self.schedule_policy = "fcfs"  # cache-aware policies need the cache
        self.resolved = True
        return self

    def _check_lora(self) -> None:
        count = len(self.lora_adapters())
        if self.enable_lora and not count:  # vLLM's defaults
            self.max_loras = self.max_loras or 1
            self.max_lora_rank = self.max_lora_rank or 16
        if self.max_loras is None:
            self.max_loras = count
        if self.max_loras < count:
            raise ValueError(f"--max-loras {self.max_loras} is fewer than the {count} adapters "
                             "of --lora-paths")
        if not self.lora_enabled():
            return
        if self.speculative_algorithm is not None or self.is_embedding:
            raise ValueError("LoRA adapters serve generation without speculative decoding")
        if count == 0 and not self.max_lora_rank:
            raise ValueError("--max-loras without --lora-paths needs --max-lora-rank (and "
                             "--lora-target-modules, default all)")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be at least 1")

    def lora_enabled(self) -> bool:
        """LoRA slots exist: --lora-paths, or --max-loras for adapters loaded at run time."""
        return bool(self.lora_paths) or bool(self.max_loras)

    def lora_adapters(self) -> dict[str, str]:
        """--lora-paths as name -> path (an entry without NAME= is named by its path);
        ValueError for an empty or repeated name."""
        adapters: dict[str, str] = {}
        entries = [self.lora_paths] if isinstance(self.lora_paths, str) else self.lora_paths
        for entry in entries or ():
            name, sep, path = entry.partition("=")
            if not sep:
                name, path = entry, entry
            if not name or not path or name in adapters:
                raise ValueError(f"--lora-paths entry {entry!r}: give NAME=PATH with a new "
                                 "name, or a PATH")
            adapters[name] = path
        return adapters

    def model_overrides(self) -> dict[str, Any]:
        """--json-model-override-args as a dict ({} without it); ValueError unless it is a
        JSON object."""
        if not self.json_model_override_args:
            return {}
        return _json_object(self.json_model_override_args, "--json-model-override-args",
                            '{"num_hidden_layers": 5}')

    def max_images_per_prompt(self) -> int:
        """--limit-mm-per-prompt's image count (vLLM's JSON, e.g. '{"image": 4}'; 0 refuses
        images), DEFAULT_MAX_IMAGES without it; ValueError for anything else."""
        if not self.limit_mm_per_prompt:
            return DEFAULT_MAX_IMAGES
        limits = _json_value(self.limit_mm_per_prompt, "--limit-mm-per-prompt")
        if not isinstance(limits, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for v in limits.values()):
            raise ValueError("--limit-mm-per-prompt must be a JSON object of counts >= 0, "
                             "e.g. '{\"image\": 4}'")
        unknown = sorted(set(limits) - {"image", "video", "audio"})
        if unknown:
            raise ValueError(f"--limit-mm-per-prompt: unknown modality {unknown[0]!r} (image, "
                             "video, audio)")
        return int(limits.get("image", DEFAULT_MAX_IMAGES))

    def image_processor_overrides(self) -> dict[str, Any]:
        """--mm-processor-kwargs (vLLM's JSON object): what the image processor is built with
        in place of its preprocessor_config.json's values (Qwen-VL's max_pixels / min_pixels
        bound an image's tokens); {} without it; ValueError for anything but an object."""
        if not self.mm_processor_kwargs:
            return {}
        return _json_object(self.mm_processor_kwargs, "--mm-processor-kwargs",
                            '{"max_pixels": 1003520}')

    def _check_sizes(self) -> None:
        """Sizes that must be positive when given (None: the default), and the memory
        fraction, refused before anything is built (0 running requests would hang)."""
        for name in ("context_length", "max_total_tokens", "max_running_requests",
                     "max_prefill_tokens", "stream_interval", "num_continuous_decode_steps",
                     "cuda_graph_max_bs", "speculative_num_draft_tokens",
                     "speculative_ngram_min_match_window_size",
                     "speculative_ngram_max_match_window_size"):
            value = getattr(self, name, None)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                                 f"got {value!r}")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port!r}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got "
                             f"{self.mem_fraction_static!r}")

    def for_replica(self, dp_rank: int) -> "ServerArgs":
        """This replica's args: its own GPUs and its own tensor-parallel meeting point."""
        replica = dataclasses.replace(self, dp_size=1,
                                      base_gpu_id=self.base_gpu_id + dp_rank * self.tp_size)
        if self.tp_size > 1 and dp_rank > 0:
            replica.dist_init_addr = f"127.0.0.1:{_free_port()}"
        return replica

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_tp_ranks(self) -> range:
        """The tensor-parallel ranks this node runs (rank 0 is node 0's)."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def dist_init_method(self) -> str | None:
        """The torch.distributed URL of the tensor-parallel group (None with one rank)."""
        return f"tcp://{self.dist_init_addr}" if self.tp_size > 1 else None

    @property
    def chunked_prefill_enabled(self) -> bool:
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, groups: Iterable[str] = GROUPS) -> None:
        """Every flag of the given groups, with help, default and choices
        (core/server_flags.py)."""
        add_flags(parser, dataclasses.fields(ServerArgs), groups)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls) if f.name != "resolved"}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")

def resolve_dtype(name: str, model_dtype: str, device: str) -> torch.dtype:
    """'auto' takes the checkpoint's dtype, except on a CPU without native matmuls in it: a
    bf16 (fp16) checkpoint there computes in float32, since oneDNN emulates bf16 (fp16)
    without AVX512-BF16 / AMX (AVX512-FP16 / AMX-FP16), ~7x slower than float32 on an AVX2
    CPU. float32 holds every bf16 and fp16 value exactly, so the weights are unchanged. An
    explicit --dtype is always taken as given."""
    import torch
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
             "half": torch.float16, "float": torch.float32}
    auto = name == "auto"
    if auto:
        name = model_dtype if model_dtype in table else "bfloat16"
    if name not in table:
        raise ValueError(f"unknown --dtype {name!r}")
    dtype = table[name]
    if auto and device == "cpu" and not cpu_computes_natively(dtype):
        logger.info("dtype auto: this CPU has no native %s matmul; computing in float32",
                    name)
        return torch.float32
    return dtype


def cpu_computes_natively(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs matmuls in `dtype` on this CPU's own instructions (float32 always;
    bf16 with AVX512-BF16 or AMX, fp16 with AVX512-FP16 or AMX-FP16)."""
    import torch
    mkldnn = torch.backends.mkldnn.is_available()
    if dtype == torch.bfloat16:
        return mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return mkldnn and torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


def grammar_cache_mb() -> float:
    """RADIXSERVE_GRAMMAR_CACHE_MB: MiB of compiled grammars kept for reuse (default 512, as
    vLLM's VLLM_XGRAMMAR_CACHE_MB); checked when the server's arguments resolve, so a bad value
    is one line at start-up, not an error at the first grammar."""
    raw = os.environ.get("RADIXSERVE_GRAMMAR_CACHE_MB", "512")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError("RADIXSERVE_GRAMMAR_CACHE_MB must be a number of MiB >= 0, got "
                         f"{raw!r}")
    return value


def _with_revision(model_path: str | None, revision: str) -> str:
    """--revision applies to a hub repo id: org/name -> org/name@revision."""
    if not model_path or model_path == DEFAULT_MODEL_NAME or \
            os.path.exists(os.path.expanduser(model_path)):
        raise ValueError("--revision applies to a hub model id (org/name), not to "
                         f"{model_path or 'the bundled model'}")
    if "@" in model_path:
        raise ValueError(f"--model-path {model_path} already names a revision; drop "
                         "--revision or the @revision")
    return f"{model_path}@{revision}"


def split_host_port(address: str) -> tuple[str, int]:
    """(host, port) of a --dist-init-addr, host:port with an IPv6 host in brackets
    ([::1]:29500, host "::1"); ValueError naming the flag otherwise."""
    host, _, port = address.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or bare_ipv6:
        raise ValueError(f"--dist-init-addr {address!r} is not host:port (an IPv6 host goes "
                         "in brackets: [::1]:29500)")
    return host.removeprefix("[").removesuffix("]"), int(port)
