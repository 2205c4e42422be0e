"""Command-line flags of ServerArgs: help text, choices and group of each, and the parser
builder. Plain data, no torch: `radixserve --help` must answer fast.

Groups follow SGLang's: model, serving (HTTP), memory and scheduling, kernels (the GPU path),
parallelism, logging. `radixserve generate` and the offline benches take every group but
serving.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable

MODEL, SERVING, MEMORY, KERNELS, PARALLEL, LOGGING = (
    "model", "serving", "memory and scheduling", "kernels (GPU)", "parallelism", "logging")
GROUPS = (MODEL, SERVING, MEMORY, KERNELS, PARALLEL, LOGGING)
OFFLINE_GROUPS = tuple(g for g in GROUPS if g != SERVING)
# parallelism that only the server does (replicas, other machines)
SERVER_ONLY = frozenset({"dp_size", "load_balance_method", "nnodes", "node_rank",
                         "base_gpu_id"})

# field -> (group, help, choices or None)
FLAGS: dict[str, tuple[str, str, tuple[str, ...] | None]] = {
    "model_path": (MODEL, "an HF folder, a .gguf file, a hub id org/name[@revision], or "
                          "SmolLM2-135M-Instruct (the bundled Q4_1 GGUF)", None),
    "tokenizer_path": (MODEL, "tokenizer folder, when not the model's", None),
    "revision": (MODEL, "branch, tag or commit of a hub model (the same as "
                        "--model-path org/name@revision)", None),
    "lora_paths": (MODEL, "LoRA adapters (PEFT folders) served beside the base model, each "
                          "NAME=PATH or PATH (named by itself); a request picks one by name "
                          "(native lora_path, OpenAI model); requests share cached prefixes "
                          "with their own adapter's only",
                   None),
    "enable_lora": (MODEL, "serve LoRA adapters (vLLM's flag): without --lora-paths, "
                           "--max-loras defaults to 1 and --max-lora-rank to 16 (vLLM's "
                           "defaults) for adapters loaded at run time", None),
    "max_loras": (MODEL, "LoRA adapter slots: adapters loaded at once, those of --lora-paths "
                         "and those loaded at run time (POST /load_lora_adapter); default: "
                         "as many as --lora-paths", None),
    "max_lora_rank": (MODEL, "the largest LoRA rank the slots take (default: the largest of "
                             "--lora-paths)", None),
    "lora_target_modules": (MODEL, "the checkpoint modules the slots adapt (q_proj, k_proj, "
                                   "v_proj, o_proj, gate_proj, up_proj, down_proj, ...), or "
                                   "all (those seven where the model has them); default: "
                                   "those --lora-paths adapt, else all", None),
    "json_model_override_args": (MODEL, "a JSON object whose keys replace the model "
                                        "config's (config.json, or a GGUF's mapped config), "
                                        "e.g. '{\"num_hidden_layers\": 5}' for a shape run "
                                        "with --load-format dummy", None),
    "load_format": (MODEL, "how to read the weights; dummy: random weights (shape-only runs)",
                    ("auto", "safetensors", "gguf", "dummy")),
    "dtype": (MODEL, "compute dtype; auto: the checkpoint's (float32 on a CPU without native "
                     "bf16 / fp16 matmuls)",
              ("auto", "float32", "float16", "bfloat16")),
    "kv_cache_dtype": (MODEL, "KV cache storage: auto (the compute dtype) or FP8 with a scale "
                              "per layer (the checkpoint's, else calibrated at startup)",
                       ("auto", "fp8_e4m3", "fp8_e5m2")),
    "quantization": (MODEL, "fp8: quantise a bf16/fp16 checkpoint's linear weights to FP8 at "
                            "load (per-channel scales, dynamic per-token activations); FP8, "
                            "AWQ, GPTQ and compressed-tensors checkpoints are detected from "
                            "their config (awq / gptq / compressed-tensors, and vLLM's "
                            "awq_marlin / gptq_marlin, only name the checkpoint's method; with "
                            "--load-format dummy, awq / gptq build int4 layers)",
                     ("fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors")),
    "device": (MODEL, "auto: cuda when present", ("auto", "cuda", "cpu")),
    "context_length": (MODEL, "the context length in tokens (default: the model's "
                              "max_position_embeddings; more is refused unless "
                              "RADIXSERVE_ALLOW_LONGER_CONTEXT=1)", None),
    "skip_tokenizer_init": (MODEL, "no tokenizer: requests send input_ids", None),
    "is_embedding": (MODEL, "serve an embedding model (Qwen3-Embedding, e5-mistral: causal "
                            "decoder checkpoints pooled at the last token): "
                            "/v1/embeddings and /encode give each input's last-token final "
                            "hidden state, L2-normalised; no generation", None),
    "trust_remote_code": (MODEL, "accepted for compatibility; remote code is never run", None),
    "host": (SERVING, "address to listen on", None),
    "port": (SERVING, "port to listen on", None),
    "allowed_local_media_path": (SERVING, "a folder whose files requests may name as "
                                          "images (file:// URLs or paths; vLLM's flag); "
                                          "default: none", None),
    "limit_mm_per_prompt": (SERVING, "the most images one prompt may carry, as vLLM's JSON "
                                     "'{\"image\": 4}' (0: images refused); default 64",
                            None),
    "allowed_media_domains": (SERVING, "the only hosts image URLs may name (vLLM's flag; "
                                       "redirects are then not followed); default: any",
                              None),
    "mm_processor_kwargs": (SERVING, "overrides for the image processor, as vLLM's JSON, e.g. "
                                     "'{\"max_pixels\": 1003520}' (Qwen-VL: fewer tokens an "
                                     "image); default: the checkpoint's", None),
    "max_request_bytes": (SERVING, "larger request bodies are refused (413) unread", None),
    "shutdown_timeout": (SERVING, "seconds running requests get to finish on SIGINT/SIGTERM; "
                                  "then their streams end with an error event", None),
    "api_key": (SERVING, "require 'Authorization: Bearer KEY' on every route but /health",
                None),
    "served_model_name": (SERVING, "the model name the API reports; requests may name only "
                                   "this (without it: the model path's last part, or the "
                                   "path itself)", None),
    "max_queued_requests": (SERVING, "refuse (429) requests past this many waiting", None),
    "incremental_streaming_output": (SERVING, "native /generate streams: each chunk carries "
                                              "only the text and output_ids new since the "
                                              "previous one (default: everything so far, as "
                                              "SGLang does)", None),
    "log_level": (LOGGING, "log level of every process",
                  ("debug", "info", "warning", "error")),
    "log_requests": (LOGGING, "log each request and its output", None),
    "random_seed": (MODEL, "seed of unseeded sampling and dummy weights", None),
    "mem_fraction_static": (MEMORY, "GPU memory fraction for weights + KV cache (default "
                                    "0.88)", None),
    "max_total_tokens": (MEMORY, "KV cache size in tokens (default: from memory)", None),
    "cpu_kv_cache_bytes": (MEMORY, "KV cache bytes on CPU", None),
    "max_running_requests": (MEMORY, "most requests decoding at once", None),
    "max_prefill_tokens": (MEMORY, "most new tokens in one prefill batch", None),
    "chunked_prefill_size": (MEMORY, "prefill long prompts in chunks of this many tokens; -1 "
                                     "disables (default 8192 on GPU, 512 on CPU)", None),
    "enable_mixed_chunk": (MEMORY, "run a prefill chunk and the decode batch in one pass",
                           None),
    "schedule_policy": (MEMORY, "order of the waiting queue (lpm: longest cached prefix "
                                "first)", ("lpm", "fcfs", "dfs-weight", "random")),
    "admission_plan": (MEMORY, "cohorts: admit a burst of requests of known length "
                               "(ignore_eos) in whole cohorts, the leftover first, so cohorts "
                               "overlap (offline batch jobs; delays the first requests)",
                       ("greedy", "cohorts")),
    "enable_priority_scheduling": (MEMORY, "requests' priority (native /generate, OpenAI "
                                           "extra field, Engine.generate) orders the waiting "
                                           "queue, picks retraction victims, and a waiting "
                                           "request preempts running ones it outranks by "
                                           "--priority-scheduling-preemption-threshold",
                                   None),
    "schedule_low_priority_values_first": (MEMORY, "with priority scheduling, lower priority "
                                                   "values go first (vLLM's order; default: "
                                                   "higher first, as SGLang)", None),
    "priority_scheduling_preemption_threshold": (MEMORY, "how far a waiting request must "
                                                         "outrank a running one to preempt it",
                                                 None),
    "schedule_conservativeness": (MEMORY, "scales the admission estimate of future tokens",
                                  None),
    "num_continuous_decode_steps": (MEMORY, "decode steps per scheduler turn", None),
    "disable_radix_cache": (MEMORY, "no prefix reuse across requests", None),
    "stream_interval": (MEMORY, "send streamed output every N tokens", None),
    "enable_jump_forward": (MEMORY, "constrained decoding: append the text a grammar forces "
                                    "(fixed keys, punctuation) without a forward pass per "
                                    "token; may tokenize it differently from plain constrained "
                                    "decoding, so outputs can differ", None),
    "tool_call_parser": (SERVING, "format of the model's tool calls (default: from the chat "
                                  "template, else hermes)",
                         ("hermes", "qwen25", "qwen3", "llama3", "llama3_json",
                          "llama4_json", "pythonic", "llama4_pythonic", "mistral", "deepseek_v3",
                          "deepseekv3", "deepseek_v31", "deepseekv31", "glm45", "glm47",
                          "minimax_m2", "minimax-m2", "qwen3_coder", "openai", "harmony")),
    "exclude_tools_when_tool_choice_none": (SERVING, "tool_choice \"none\" leaves the tools out "
                                                     "of the prompt (default: they are "
                                                     "rendered, as vLLM does, but no call is "
                                                     "parsed)", None),
    "reasoning_parser": (SERVING, "a thinking model's format: its <think> block goes to the "
                                  "chat response's reasoning_content (default: none, all "
                                  "of it is content; gpt-oss's channels are split without it)",
                         ("deepseek-r1", "deepseek_r1", "qwen3", "glm45", "gpt-oss",
                          "openai_gptoss", "minimax_m2", "minimax-m2", "nano_v3",
                          "nemotron_v3")),
    "speculative_algorithm": (MEMORY, "speculative decoding; ngram: each step also verifies "
                                      "tokens that followed an earlier occurrence of the "
                                      "sequence's last few tokens (prompt lookup), so a step "
                                      "can emit several; outputs are those of plain decoding "
                                      "(greedy and seeded sampling alike)", ("ngram",)),
    "speculative_num_draft_tokens": (MEMORY, "most drafted tokens verified per request and "
                                             "step", None),
    "speculative_ngram_min_match_window_size": (MEMORY, "ngram: the shortest suffix that may "
                                                        "match", None),
    "speculative_ngram_max_match_window_size": (MEMORY, "ngram: the longest suffix matched",
                                                None),
    "attention_backend": (KERNELS, "attention kernels (default: triton on GPU, cpu on CPU: "
                                   "torch_native with compiled CPU kernels)",
                          ("cpu", "torch_native", "triton")),
    "prefill_attention_backend": (KERNELS, "another backend for prefill only",
                                  ("cpu", "torch_native", "triton")),
    "decode_attention_backend": (KERNELS, "another backend for decode only",
                                 ("cpu", "torch_native", "triton")),
    "disable_cuda_graph": (KERNELS, "decode without CUDA graphs", None),
    "disable_overlap_schedule": (KERNELS, "read each decode step's tokens before launching "
                                          "the next", None),
    "cuda_graph_max_bs": (KERNELS, "largest decode batch captured in a graph (default 512 on "
                                   "GPUs over 100 GB, else 256)", None),
    "tp_size": (PARALLEL, "tensor-parallel ranks (GPUs) per replica", None),
    "dist_init_addr": (PARALLEL, "host:port where the ranks meet (required with --nnodes)",
                       None),
    "nnodes": (PARALLEL, "machines the tensor-parallel ranks span", None),
    "node_rank": (PARALLEL, "this machine's index; node 0 serves HTTP", None),
    "watchdog_timeout": (SERVING, "seconds one scheduler turn may run before the server is "
                                  "taken down as hung (a stopped rank, a wedged device); 0: "
                                  "never", None),
    "dist_timeout": (PARALLEL, "seconds the tensor-parallel ranks wait for each other to "
                               "join (and at a collective)", None),
    "dp_size": (PARALLEL, "data-parallel replicas behind this server", None),
    "load_balance_method": (PARALLEL, "how requests are spread over the replicas",
                            ("round_robin", "shortest_queue", "cache_aware")),
    "base_gpu_id": (PARALLEL, "first GPU index this server uses", None),
}


# other projects' names for the same flags, accepted beside ours (vLLM's, SGLang's)
ALIASES: dict[str, tuple[str, ...]] = {"lora_paths": ("--lora-modules",),
                                       "max_loras": ("--max-loras-per-batch",)}


def _type_of(field: dataclasses.Field) -> Any:
    name = str(field.type).replace(" | None", "")
    return {"int": int, "float": float}.get(name, str)


def add_flags(parser: argparse.ArgumentParser, fields: Iterable[dataclasses.Field],
              groups: Iterable[str] = GROUPS) -> None:
    """One argparse group per flag group, flags in declaration order, each with its help,
    default and choices. Without the serving group (offline tools), the server-only
    parallelism flags are left out too."""
    wanted = list(groups)
    offline = SERVING not in wanted
    sections = {g: parser.add_argument_group(f"{g} options") for g in wanted}
    for field in fields:
        if field.name not in FLAGS or (offline and field.name in SERVER_ONLY):
            continue
        group, text, choices = FLAGS[field.name]
        if group not in sections:
            continue
        flags = ("--" + field.name.replace("_", "-"), *ALIASES.get(field.name, ()))
        default = field.default
        if isinstance(default, bool):
            sections[group].add_argument(*flags, action="store_true", default=default,
                                         help=text)
            continue
        nargs = "+" if str(field.type).startswith("list[") else None
        sections[group].add_argument(*flags, type=_type_of(field), default=default, nargs=nargs,
                                     choices=choices, help=_with_default(text, default))


def _with_default(text: str, default: Any) -> str:
    """The help text with its default, unless the text already says it (a default of None
    means the text must: "auto" would say nothing, or contradict it)."""
    if "default" in text or default is None:
        return text
    return f"{text} (default: {default})"
