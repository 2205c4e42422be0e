"""Per-request sampling parameters, validated before anything is scheduled."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

_MAX_TOP_LOGPROBS = 20
MAX_N = 128  # samples per prompt (n)
GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")
# set by the server, not request fields
_INTERNAL_FIELDS = ("stop_strs", "stop_str_max_len", "keep_special_tokens", "reasoning_gate")
# a reasoning gate's states (scheduler/grammar/matcher.py): inside the think block, before the
# output's first token says whether it opens one, in the answer the grammar constrains
GATE_THINKING, GATE_UNDECIDED, GATE_ANSWER = "thinking", "undecided", "answer"


def _as_token_id(token: Any) -> int | None:
    """A non-negative token id from an int or a decimal string (JSON object keys), else None."""
    if isinstance(token, bool):
        return None
    if isinstance(token, int):
        return token if token >= 0 else None
    if isinstance(token, str) and token.isascii() and token.isdigit():  # not "²" or "١٢"
        return int(token)
    return None


class InvalidRequestError(ValueError):
    """Raised for bad user input; the server maps it to HTTP 400 (naming `param` when the
    error is about one request field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32 (penalties are float32)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: the matched stop string, or the stop token's text (EOS or stop_token_ids), stays
    # in the output text (by default both are left out, as vLLM and OpenAI leave them out)
    include_stop_str_in_output: bool = False
    # special tokens (by text) that stay in the output text while skip_special_tokens drops the
    # others: the chat handler's tool-call marker when it is a special token ([TOOL_CALLS],
    # <|python_tag|>); set by the server, not a request field
    keep_special_tokens: tuple[str, ...] = ()
    # a thinking model's grammar starts after its reasoning (scheduler/grammar/matcher.py
    # `ReasoningGate`): (start tag's token id, end tag's, initial state); set by the chat
    # handler with --reasoning-parser, not a request field
    reasoning_gate: tuple[int, int, str] | None = None
    n: int = 1
    seed: int | None = None
    # token id -> bias added to its logit before sampling (OpenAI's logit_bias, in [-100, 100];
    # JSON keys arrive as strings, normalize() makes them ints)
    logit_bias: dict[Any, float] | None = None
    # constrained decoding (SGLang's names; at most one): a regular expression, a JSON schema
    # (a JSON string, or an object that normalize() serialises) or an EBNF grammar (xgrammar's
    # dialect) the output must match
    regex: str | None = None
    json_schema: Any = None
    ebnf: str | None = None
    # filled by normalize(): stop strings as a list, and the longest one in UTF-8 bytes
    stop_strs: list[str] = field(default_factory=list, repr=False)
    stop_str_max_len: int = field(default=0, repr=False)

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        params = dict(params or {})
        known = {f for f in cls.__dataclass_fields__ if f not in _INTERNAL_FIELDS}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**params)

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar, or None when unconstrained (after
        normalize(): json_schema is a string then)."""
        for kind in GRAMMAR_KINDS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    def for_sample(self, j: int) -> "SamplingParams":
        """The params of sample j of n: a seeded request's sample j uses seed + j (identical
        seeds would make the n samples identical, which is not what n asks for)."""
        return self if self.seed is None else replace(self, seed=self.seed + j)

    def verify(self) -> None:
        """Raise InvalidRequestError with a clear message for any out-of-range value."""
        def check(ok: bool, msg: str, param: str) -> None:
            if not ok:
                raise InvalidRequestError(msg, param=param)

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool),
                  f"{name} must be an integer, got {value!r}", name)
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool)
                  and math.isfinite(value), f"{name} must be a finite number, got {value!r}", name)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            value = getattr(self, name)  # the detokenizer and the stop checks take real bools
            check(isinstance(value, bool), f"{name} must be true or false, got {value!r}", name)
        check(self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}",
              "max_new_tokens")
        check(0 <= self.min_new_tokens <= self.max_new_tokens,
              f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}",
              "min_new_tokens")
        check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}",
              "temperature")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        check(self.top_k >= -1,  # 0 and -1 both mean all tokens, as in vLLM
              f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}", "top_k")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        check(-2.0 <= self.frequency_penalty <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
              "frequency_penalty")
        check(-2.0 <= self.presence_penalty <= 2.0,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
              "presence_penalty")
        # vLLM's bound (SGLang v0.2 capped it at 2), within float32 (inf would turn a zero
        # logit into NaN)
        check(0.0 < self.repetition_penalty <= FLOAT32_MAX,
              f"repetition_penalty must be > 0 (and a float32), got {self.repetition_penalty}",
              "repetition_penalty")
        check(1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}", "n")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
              f"seed must be an integer, got {self.seed!r}", "seed")
        check(self.seed is None or -2**63 <= self.seed < 2**63,  # a 64-bit seed, as vLLM's API
              f"seed must be a 64-bit integer, in [-2^63, 2^63), got {self.seed}", "seed")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            check(isinstance(stops, list) and all(isinstance(s, str) for s in stops),
                  f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
            check(all(len(s) > 0 for s in stops), "stop strings must not be empty", "stop")
            check(len(stops) <= 16, f"at most 16 stop strings are allowed, got {len(stops)}",
                  "stop")
        if self.stop_token_ids is not None:
            check(isinstance(self.stop_token_ids, list)
                  and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                          for t in self.stop_token_ids),
                  "stop_token_ids must be a list of non-negative integers, got "
                  f"{self.stop_token_ids!r}", "stop_token_ids")
        self._verify_grammar()
        if self.logit_bias is not None:
            check(isinstance(self.logit_bias, dict),
                  f"logit_bias must map token ids to numbers, got {self.logit_bias!r}",
                  "logit_bias")
            for token, bias in self.logit_bias.items():
                check(_as_token_id(token) is not None,
                      f"logit_bias keys must be token ids, got {token!r}", "logit_bias")
                check(isinstance(bias, (int, float)) and not isinstance(bias, bool)
                      and -100.0 <= bias <= 100.0,
                      f"logit_bias values must be numbers in [-100, 100], got {bias!r}",
                      "logit_bias")

    def _verify_grammar(self) -> None:
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise InvalidRequestError("give at most one of regex, json_schema and ebnf, got "
                                      + ", ".join(given), param=given[1])
        for kind in given:
            value = getattr(self, kind)
            ok = isinstance(value, str) or (kind == "json_schema" and isinstance(value, dict))
            if not ok or len(value) == 0:
                what = "a JSON string or object" if kind == "json_schema" else "a string"
                raise InvalidRequestError(f"{kind} must be a non-empty {what}, got {value!r}",
                                          param=kind)

    def normalize(self) -> None:
        """Resolve derived fields (call after verify)."""
        if self.logit_bias:
            self.logit_bias = {_as_token_id(t): float(b) for t, b in self.logit_bias.items()}
        else:
            self.logit_bias = None
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        if self.stop is None:
            self.stop_strs = []
        else:
            self.stop_strs = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        # in UTF-8 bytes: a byte-level BPE token holds at least one byte, so a stop string of
        # B bytes spans at most B tokens (a CJK character or an emoji can take several tokens)
        self.stop_str_max_len = max((len(s.encode("utf-8")) for s in self.stop_strs), default=0)
        if self.top_k == 0:
            self.top_k = -1
        if self.temperature <= 1e-6:
            # greedy: make every other knob a no-op so batches can take the argmax fast path
            self.temperature = 0.0
            self.top_k = 1

    @staticmethod
    def check_top_logprobs_num(num: int) -> None:
        if not (0 <= num <= _MAX_TOP_LOGPROBS):
            raise InvalidRequestError(
                f"top_logprobs_num must be in [0, {_MAX_TOP_LOGPROBS}], got {num}")
