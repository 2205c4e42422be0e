"""Benchmark workloads: lists of SampleRequest built from random tokens or a ShareGPT file.

Invariants:
  * `random`: every prompt has exactly `prompt_len` token ids and asks for exactly `output_len`
    tokens; both lengths are drawn uniformly from [int(len * range_ratio), len] (at least 1).
  * `generated-shared-prefix`: group g's prompts are `system_prompt[g] + question[g][p]`; every
    prompt of a group shares the first `system_prompt_len` ids, groups share nothing on purpose
    (their system prompts are drawn independently).
  * All generators are deterministic functions of their seed.
No download is needed except for the ShareGPT layout, which reads a local file.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from radixserve.bench.cli_support import (BenchError, existing_file, fraction, int_at_least,
                                          parse_json_lines, read_text)

# Without a tokenizer, random token ids are drawn from this range: above the special tokens
# most vocabularies keep at the bottom, below the smallest vocabulary we expect (32000).
DEFAULT_TOKEN_RANGE = (1000, 30000)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class SampleRequest:
    """One request of a workload. `prompt_ids` is set when the prompt is token ids (random,
    shared-prefix); `prompt_text` when it is text (ShareGPT, or ids decoded for a chat API)."""
    prompt_len: int
    output_len: int
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    group: int = 0


class TokenSampler:
    """Draws random token ids, avoiding a tokenizer's special tokens when one is known."""

    def __init__(self, tokenizer: Tokenizer | None = None, vocab_size: int | None = None) -> None:
        low, high = DEFAULT_TOKEN_RANGE
        special: set[int] = set()
        if tokenizer is not None:
            size = len(tokenizer)  # type: ignore[arg-type]
            low, high = 0, min(size, vocab_size) if vocab_size else size
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
        elif vocab_size is not None:
            high = min(high, vocab_size)
            low = min(low, high // 2)
        ids = np.arange(low, high, dtype=np.int64)
        if special:
            ids = ids[~np.isin(ids, np.fromiter(special, dtype=np.int64))]
        if ids.size == 0:
            raise ValueError("no token ids left to sample from")
        self.allowed_ids = ids

    def sample(self, rng: np.random.Generator, length: int) -> list[int]:
        return self.allowed_ids[rng.integers(0, self.allowed_ids.size, size=length)].tolist()


def uniform_lengths(rng: np.random.Generator, length: int, range_ratio: float,
                    count: int) -> list[int]:
    """`count` ints uniform in [max(1, int(length * range_ratio)), length], both ends included."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(length * range_ratio))
    return rng.integers(low, length + 1, size=count).tolist()


def sample_random_requests(num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float = 1.0, seed: int = 0,
                           token_sampler: TokenSampler | None = None) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    sampler = token_sampler or TokenSampler()
    input_lens = uniform_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = uniform_lengths(rng, output_len, range_ratio, num_prompts)
    return [SampleRequest(prompt_len=n_in, output_len=n_out, prompt_ids=sampler.sample(rng, n_in))
            for n_in, n_out in zip(input_lens, output_lens)]


def sample_shared_prefix_requests(num_groups: int, prompts_per_group: int, system_prompt_len: int,
                                  question_len: int, output_len: int, seed: int = 0,
                                  shuffle: bool = False,
                                  token_sampler: TokenSampler | None = None
                                  ) -> list[SampleRequest]:
    """G groups x P prompts; prompts are emitted group after group unless `shuffle`."""
    rng = np.random.default_rng(seed)
    sampler = token_sampler or TokenSampler()
    requests: list[SampleRequest] = []
    for group in range(num_groups):
        system_ids = sampler.sample(rng, system_prompt_len)
        for _ in range(prompts_per_group):
            ids = system_ids + sampler.sample(rng, question_len)
            requests.append(SampleRequest(prompt_len=len(ids), output_len=output_len,
                                          prompt_ids=ids, group=group))
    if shuffle:
        random.Random(seed).shuffle(requests)
    return requests


def _first_exchange(entry: dict[str, Any]) -> tuple[str, str] | None:
    """The first human turn and the reply to it, from ShareGPT ({from, value}) or chat
    ({role, content}) layout; None if the conversation has no such pair."""
    turns = entry.get("conversations") or entry.get("conversation") or entry.get("messages")
    if not isinstance(turns, list) or len(turns) < 2:
        return None

    def speaker(turn: dict[str, Any]) -> str:
        return str(turn.get("from", turn.get("role", ""))).lower()

    def words(turn: dict[str, Any]) -> str:
        return str(turn.get("value", turn.get("content", "")))

    for first, second in zip(turns, turns[1:]):
        if speaker(first) in ("human", "user") and speaker(second) in ("gpt", "assistant"):
            return words(first), words(second)
    return None


def load_conversations(path: str) -> list[dict[str, Any]]:
    """A JSON list, or JSONL with one conversation object per line (BenchError if neither)."""
    text = read_text(path)
    if text.lstrip().startswith("["):
        try:
            entries = json.loads(text)
        except ValueError as exc:
            raise BenchError(f"{path}: not valid JSON ({exc})")
    else:
        entries = parse_json_lines(path, text)
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise BenchError(f"{path}: not a list of conversation objects")
    return entries


def sample_sharegpt_requests(path: str, num_prompts: int, tokenizer: Tokenizer,
                             fixed_output_len: int | None = None, seed: int = 0,
                             min_len: int = 4, max_prompt_len: int = 1024,
                             max_total_len: int = 2048) -> list[SampleRequest]:
    """Prompt = first human turn (text); output length = token length of the reply to it,
    or `fixed_output_len`. Very short or very long exchanges are skipped."""
    entries = load_conversations(path)
    random.Random(seed).shuffle(entries)
    requests: list[SampleRequest] = []
    for entry in entries:
        if len(requests) >= num_prompts:
            break
        pair = _first_exchange(entry)
        if pair is None:
            continue
        prompt, reply = pair
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = fixed_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < min_len or (output_len < min_len and fixed_output_len is None):
            continue
        if prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        requests.append(SampleRequest(prompt_len=prompt_len, output_len=output_len,
                                      prompt_text=prompt))
    if len(requests) < num_prompts:
        print(f"warning: {path} gave only {len(requests)} usable conversations "
              f"of the {num_prompts} asked for")
    return requests


def load_tokenizer(name: str | None, model: str | None = None) -> Tokenizer | None:
    """`name` (--tokenizer) is what the server's --tokenizer-path takes: a folder of tokenizer
    files, a model the loader resolves (a folder, a .gguf file, the bundled model's name) or a
    hub id. Without it: the tokenizer of `model`, else of the bundled model, through the
    loader; None (with a note) when that cannot be had."""
    from radixserve.config import DEFAULT_MODEL_NAME
    from radixserve.loader.tokenizer import get_tokenizer, load_tokenizer_path
    if name:
        return load_tokenizer_path(name, flag="--tokenizer")
    target = model or DEFAULT_MODEL_NAME
    try:
        return get_tokenizer(target)
    except Exception as exc:  # noqa: BLE001 - the benchmark runs on raw token ids instead
        print(f"note: no tokenizer for {target} ({exc}); using raw token ids")
        return None


def attach_prompt_text(requests: list[SampleRequest], tokenizer: Tokenizer) -> None:
    """Decode token-id prompts to text (for APIs that only take text, such as chat)."""
    for req in requests:
        if req.prompt_text is None and req.prompt_ids is not None:
            req.prompt_text = tokenizer.decode(req.prompt_ids, skip_special_tokens=True)


DATASETS = ("random", "generated-shared-prefix", "sharegpt")


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The workload flags shared by `bench serving` and `bench offline`."""
    p = parser
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", type=existing_file, default=None,
                   help="ShareGPT-layout JSON or JSONL file")
    p.add_argument("--num-prompts", type=int_at_least(0), default=1000)
    p.add_argument("--random-input-len", type=int_at_least(1), default=1024)
    p.add_argument("--random-output-len", type=int_at_least(1), default=128)
    p.add_argument("--random-range-ratio", type=fraction, default=1.0)
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument("--gsp-shuffle", action="store_true", help="interleave the groups")
    p.add_argument("--sharegpt-output-len", type=int_at_least(1), default=None,
                   help="override each conversation's reply length")


def build_dataset(args: argparse.Namespace, tokenizer: Tokenizer | None, seed: int,
                  vocab_size: int | None = None) -> list[SampleRequest]:
    """The workload `add_dataset_args` describes (--num-prompts is ignored by the shared-prefix
    set, whose size is groups x prompts per group)."""
    sampler = TokenSampler(tokenizer, vocab_size)
    if args.dataset_name == "random":
        return sample_random_requests(args.num_prompts, args.random_input_len,
                                      args.random_output_len, args.random_range_ratio, seed,
                                      sampler)
    if args.dataset_name == "generated-shared-prefix":
        return sample_shared_prefix_requests(
            args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
            args.gsp_question_len, args.gsp_output_len, seed, args.gsp_shuffle, sampler)
    if not args.dataset_path:
        raise BenchError("--dataset-name sharegpt needs --dataset-path")
    if tokenizer is None:
        raise BenchError("the sharegpt dataset needs a tokenizer: pass --tokenizer")
    return sample_sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer,
                                    args.sharegpt_output_len, seed)


def check_asks_for_requests(args: argparse.Namespace) -> None:
    """BenchError when the workload flags ask for no request at all (before a model loads)."""
    if args.dataset_name == "generated-shared-prefix":
        count = args.gsp_num_groups * args.gsp_prompts_per_group
    else:
        count = args.num_prompts
    if count <= 0:
        raise BenchError("the workload flags ask for no requests")


def check_not_empty(requests: list[SampleRequest]) -> list[SampleRequest]:
    if not requests:
        raise BenchError("the dataset produced no requests")
    return requests
