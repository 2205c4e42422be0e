"""Every message that crosses a process boundary. Sent with pickle over ZMQ (send_pyobj).

  TokenizerManager --(TokenizedGenerateReq, AbortReq, FlushCacheReq, GetInternalStateReq,
                      LoadLoRAReq, UnloadLoRAReq)--> Scheduler
  Scheduler --(BatchTokenIDOut, and pass-through replies)--> DetokenizerManager
  DetokenizerManager --(BatchStrOut, and the replies unchanged)--> TokenizerManager
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.core.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams  # verified and normalized
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    lora_name: str | None = None  # a --lora-paths adapter, or the base model
    priority: int | None = None  # with --enable-priority-scheduling
    # the prompt's images (core.multimodal.ImageInput), their placeholders expanded in
    # input_ids
    mm_inputs: list[Any] | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheReply:
    success: bool
    message: str = ""
    dp_rank: int = 0  # the data-parallel replica that answers


@dataclass
class LoadLoRAReq:
    """Load the LoRA adapter folder `path` into a free slot under `name`."""
    name: str
    path: str


@dataclass
class UnloadLoRAReq:
    """Free `name`'s slot (the front end has waited for its requests to finish)."""
    name: str


@dataclass
class LoRAUpdateReply:
    success: bool
    message: str = ""
    dp_rank: int = 0


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class InternalState:
    """Scheduler state for /get_server_info and /metrics."""
    num_running_reqs: int
    num_queued_reqs: int
    max_total_num_tokens: int
    available_tokens: int
    evictable_tokens: int
    protected_tokens: int
    token_usage: float
    cache_hit_rate: float
    num_retractions: int
    new_token_ratio: float
    memory_check_ok: bool | None  # None while not idle
    leaked_tokens: int
    dp_rank: int = 0  # the data-parallel replica that answers
    num_recomputed_tokens: int = 0  # prefilled again after a retraction
    # decode steps run since the start (each reads the weights once, whatever its batch)
    num_decode_steps: int = 0
    # speculative decoding: requests that verified drafts (one per step), drafts proposed
    # and accepted, since the start
    spec_verified_reqs: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accept_length: float = field(init=False, default=0.0)
    spec_accept_rate: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        # what /get_server_info shows: tokens a request gains per step it verifies drafts
        # (SGLang's "accept len"), and accepted / proposed drafts; 0 without speculation
        verified, proposed = self.spec_verified_reqs, self.spec_proposed_tokens
        self.spec_accept_length = \
            1.0 + self.spec_accepted_tokens / verified if verified else 0.0
        self.spec_accept_rate = self.spec_accepted_tokens / proposed if proposed else 0.0

    @classmethod
    def merge(cls, states: list["InternalState"]) -> "InternalState":
        """Several data-parallel replicas as one: counts and tokens summed, ratios averaged,
        the memory check passed only when every replica's did (None while one is busy)."""
        if len(states) == 1:
            return states[0]
        n = len(states)
        checks = [s.memory_check_ok for s in states]
        return cls(
            num_running_reqs=sum(s.num_running_reqs for s in states),
            num_queued_reqs=sum(s.num_queued_reqs for s in states),
            max_total_num_tokens=sum(s.max_total_num_tokens for s in states),
            available_tokens=sum(s.available_tokens for s in states),
            evictable_tokens=sum(s.evictable_tokens for s in states),
            protected_tokens=sum(s.protected_tokens for s in states),
            token_usage=sum(s.token_usage for s in states) / n,
            cache_hit_rate=sum(s.cache_hit_rate for s in states) / n,
            num_retractions=sum(s.num_retractions for s in states),
            num_recomputed_tokens=sum(s.num_recomputed_tokens for s in states),
            num_decode_steps=sum(s.num_decode_steps for s in states),
            new_token_ratio=sum(s.new_token_ratio for s in states) / n,
            spec_verified_reqs=sum(s.spec_verified_reqs for s in states),
            spec_proposed_tokens=sum(s.spec_proposed_tokens for s in states),
            spec_accepted_tokens=sum(s.spec_accepted_tokens for s in states),
            memory_check_ok=None if None in checks else all(checks),  # type: ignore[arg-type]
            leaked_tokens=sum(s.leaked_tokens for s in states))


@dataclass
class SchedulerStateUpdate:
    """A scheduler's state sent unasked, every STATE_UPDATE_INTERVAL_S while it works and
    once each time it goes idle: /metrics reads the latest instead of waiting for a turn to
    end (a long prefill turn held a scrape for seconds). Its memory check is not run."""
    state: InternalState


@dataclass
class ReqError:
    """The scheduler refused a request (e.g. queue full), or the detokenizer failed on it
    (still_scheduled: the scheduler runs it on, so its consumer aborts it there).
    http_status picks the response code."""
    rid: str
    message: str
    http_status: int = 400
    still_scheduled: bool = False


@dataclass
class BatchTokenIDOut:
    """New tokens since the last message, per request. Finished requests appear once more with
    finished_reason set. meta_infos hold cumulative counts and the *new* logprob entries."""
    rids: list[str]
    new_output_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    meta_infos: list[dict[str, Any]]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    stop_strs: list[list[str]] = field(default_factory=list)
    keep_special_tokens: list[tuple[str, ...]] = field(default_factory=list)
    include_stop: list[bool] = field(default_factory=list)  # include_stop_str_in_output


@dataclass
class BatchStrOut:
    rids: list[str]
    text_deltas: list[str]
    new_output_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    meta_infos: list[dict[str, Any]]
