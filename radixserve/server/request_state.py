"""What the TokenizerManager knows about one in-flight request, and what it hands to the API.

A request moves through: GenerateRequest (validated, tokenized) -> ReqState (accumulates the
BatchStrOut pieces from the detokenizer) -> ReqOutput snapshots (cumulative text, ids and
meta_info, as SGLang's /generate returns them).

Logprob entries in meta_info use SGLang's shape: (logprob, token_id, token_text or None); top
logprobs are a list of such entries per position (None where there is none).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from radixserve.core.io_struct import ReqError
from radixserve.core.sampling_params import SamplingParams

LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs",
                "output_top_logprobs")

LogprobEntry = tuple[float | None, int, str | None]


@dataclass
class GenerateRequest:
    """One prompt, one sample, ready for the scheduler."""
    rid: str
    input_ids: list[int]
    input_text: str | None
    sampling_params: SamplingParams  # verified and normalized
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_name: str | None = None  # a --lora-paths adapter, or the base model
    priority: int | None = None  # with --enable-priority-scheduling
    # the prompt's images (core.multimodal.ImageInput), placeholders expanded in input_ids
    mm_inputs: list[Any] | None = None
    # the server's own request (n > 1's shared-prefix prefill): no client asked, so the
    # request metrics leave it out
    internal: bool = False


@dataclass
class ReqOutput:
    """A snapshot of a request's output so far (everything cumulative)."""
    rid: str
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    finished: bool

    def to_json(self, with_output_ids: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"text": self.text}
        if with_output_ids:
            out["output_ids"] = self.output_ids
        out["meta_info"] = self.meta_info
        return out


TokenTextFn = Callable[[list[int]], list[str | None]]


@dataclass
class ReqState:
    req: GenerateRequest
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta_info: dict[str, Any] = field(default_factory=dict)
    logprobs: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in LOGPROB_KEYS})
    finished: bool = False
    error: ReqError | None = None
    disconnected: bool = False  # its HTTP client went away (set by the disconnect watcher)
    # an abort of it counts in the metrics (not where another part of its request was refused)
    counted: bool = True
    created_time: float = field(default_factory=time.perf_counter)
    created_wall: float = field(default_factory=time.time)  # against the scheduler's clock
    first_token_time: float | None = None
    last_token_time: float | None = None

    def add_piece(self, text_delta: str, new_ids: list[int], meta_info: dict[str, Any],
                  finished_reason: dict[str, Any] | None, token_text: TokenTextFn) -> None:
        """Fold one BatchStrOut entry in."""
        self.text += text_delta
        self.output_ids.extend(new_ids)
        for key, value in meta_info.items():
            if key in LOGPROB_KEYS:
                self.logprobs[key].extend(_convert_logprobs(key, value, token_text))
            else:
                self.meta_info[key] = value
        if finished_reason is not None:
            self.finished = True
            self.meta_info["finish_reason"] = finished_reason

    def snapshot(self) -> ReqOutput:
        meta: dict[str, Any] = {"id": self.req.rid, **self.meta_info}
        meta.setdefault("prompt_tokens", len(self.req.input_ids))
        meta["completion_tokens"] = max(meta.get("completion_tokens", 0), len(self.output_ids))
        meta.setdefault("cached_tokens", 0)
        meta.setdefault("finish_reason", None)
        if self.req.return_logprob:
            for key in LOGPROB_KEYS:
                meta[key] = list(self.logprobs[key])
        return ReqOutput(rid=self.req.rid, text=self.text, output_ids=list(self.output_ids),
                         meta_info=meta, finished=self.finished)


def _convert_logprobs(key: str, entries: list[Any], token_text: TokenTextFn) -> list[Any]:
    if key.endswith("_top_logprobs"):
        return [None if not top else _with_text(top, token_text) for top in entries]
    return _with_text(entries, token_text)


def _with_text(entries: list[Any], token_text: TokenTextFn) -> list[LogprobEntry]:
    pairs = [(None if e[0] is None else float(e[0]), int(e[1])) for e in entries]
    texts = token_text([tid for _, tid in pairs])
    return [(lp, tid, text) for (lp, tid), text in zip(pairs, texts)]
