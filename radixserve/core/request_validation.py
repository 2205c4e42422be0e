"""The one validation path of a generate request, shared by the HTTP server
(TokenizerManager), the offline Engine and the scheduler.

`validate_request` is what a front end runs before sending a request: the sampling parameters,
then the prompt (`check_prompt`), then the length budget (prompt + max_new_tokens must fit the
context, as the OpenAI API and vLLM refuse it, and the KV cache, which could never admit it).
The scheduler re-runs `check_prompt` on what it receives (it is the authority on its pools); it
does not refuse a budget past the context, which it ends at the context length instead, and
cuts one past the KV cache to what the cache holds, for callers that bypass the front ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.core.sampling_params import InvalidRequestError, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    context_len: int
    vocab_size: int
    max_total_tokens: int | None = None  # KV cache size, in tokens
    max_prefill_tokens: int | None = None  # the longest prompt when chunked prefill is off
    lora_names: tuple[str, ...] = ()  # the LoRA adapters served (--lora-paths)
    priority_scheduling: bool = False  # --enable-priority-scheduling: requests may set priority

    @property
    def max_sequence_tokens(self) -> int:
        """The most tokens one request's prompt and output can reach: the context length, or
        the KV cache less one token when that is smaller (a request alone is always admitted
        within it: the admission keeps one free token per running request)."""
        if self.max_total_tokens is None:
            return self.context_len
        return min(self.context_len, self.max_total_tokens - 1)

    @classmethod
    def from_model_info(cls, info: dict[str, Any]) -> "RequestLimits":
        return cls(int(info["context_len"]), int(info.get("vocab_size") or 0),
                   info.get("max_total_num_tokens"), info.get("max_prefill_tokens"),
                   tuple(info.get("lora_adapters") or ()),
                   bool(info.get("priority_scheduling")))


def check_lora_name(name: str | None, limits: RequestLimits) -> None:
    """A request's LoRA adapter must be one the server loaded (None: the base model)."""
    if name is not None and name not in limits.lora_names:
        served = ", ".join(repr(n) for n in limits.lora_names) or "none"
        raise InvalidRequestError(f"unknown LoRA adapter {name!r} (served: {served})",
                                  param="lora_path")


def _ids_in_range(input_ids: list[int], vocab_size: int) -> bool:
    """Every id an int in [0, vocab_size): min and max of a list of ints run in C."""
    try:
        return 0 <= min(input_ids) and max(input_ids) < vocab_size
    except TypeError:  # not all comparable numbers: fall back to the per-id check
        return all(isinstance(t, int) and 0 <= t < vocab_size for t in input_ids)


def check_prompt(input_ids: list[int], limits: RequestLimits) -> None:
    """The prompt alone: non-empty, known token ids, and room left after it for one output
    token in the context and in the KV cache (and in one prefill when chunked prefill is
    off)."""
    n = len(input_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if limits.vocab_size and not _ids_in_range(input_ids, limits.vocab_size):
        raise InvalidRequestError(f"input_ids must be in [0, {limits.vocab_size})",
                                  param="prompt")
    if n >= limits.context_len:
        raise InvalidRequestError(
            f"The input ({n} tokens) is longer than the model's context length "
            f"({limits.context_len} tokens): at most {limits.context_len - 1} prompt tokens "
            "are allowed.", param="prompt")
    if limits.max_total_tokens is not None and n >= limits.max_sequence_tokens:
        # as the context check: a prompt must leave room for one output token
        raise InvalidRequestError(
            f"The input ({n} tokens) is too long for the KV cache: it holds "
            f"{limits.max_total_tokens} tokens, so one request's prompt and output reach at "
            f"most {limits.max_sequence_tokens} tokens: at most {limits.max_sequence_tokens - 1}"
            " prompt tokens are allowed.", param="prompt")
    if limits.max_prefill_tokens is not None and n > limits.max_prefill_tokens:
        raise InvalidRequestError(
            f"the prompt has {n} tokens, more than --max-prefill-tokens "
            f"({limits.max_prefill_tokens}) with chunked prefill disabled", param="prompt")


def validate_request(input_ids: list[int], sampling_params: SamplingParams,
                     limits: RequestLimits, logprob_start_len: int = -1,
                     top_logprobs_num: int = 0, lora_name: str | None = None,
                     priority: int | None = None) -> None:
    """Everything about one request (its LoRA adapter and priority too); normalises
    `sampling_params` in place. Raises InvalidRequestError with a message for the user."""
    if priority is not None and not limits.priority_scheduling:
        raise InvalidRequestError("priority needs a server started with "
                                  "--enable-priority-scheduling", param="priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise InvalidRequestError("priority must be an integer", param="priority")
    sampling_params.verify()
    sampling_params.normalize()
    SamplingParams.check_top_logprobs_num(top_logprobs_num)
    check_prompt(input_ids, limits)
    if sampling_params.logit_bias and limits.vocab_size and \
            any(t >= limits.vocab_size for t in sampling_params.logit_bias):
        raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {limits.vocab_size})",
                                  param="logit_bias")
    n = len(input_ids)
    if n + sampling_params.max_new_tokens > limits.context_len:
        raise InvalidRequestError(
            f"Requested {n + sampling_params.max_new_tokens} tokens ({n} in the prompt, "
            f"{sampling_params.max_new_tokens} to generate), but the model's context length is "
            f"{limits.context_len} tokens. Reduce the prompt or max_tokens.", param="max_tokens")
    if n + sampling_params.max_new_tokens > limits.max_sequence_tokens:
        # a request the KV cache cannot hold whole would wait in the queue forever
        raise InvalidRequestError(
            f"Requested {n + sampling_params.max_new_tokens} tokens ({n} in the prompt, "
            f"{sampling_params.max_new_tokens} to generate), but the KV cache holds "
            f"{limits.max_total_tokens} tokens: at most {limits.max_sequence_tokens - n} to "
            "generate. Reduce the prompt or max_tokens.", param="max_tokens")
    if logprob_start_len >= n:
        raise InvalidRequestError(f"logprob_start_len must be < the prompt length ({n})",
                                  param="logprob_start_len")
    check_lora_name(lora_name, limits)
