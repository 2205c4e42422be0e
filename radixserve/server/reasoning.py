"""The reasoning of thinking models, split from the answer (`--reasoning-parser`).

DeepSeek-R1 and Qwen3 write their reasoning between `<think>` and `</think>` before the answer.
With a parser the chat route returns it as `message.reasoning_content` (streamed as
`delta.reasoning_content`), as vLLM and SGLang do, and the answer alone as `content`, which
is also what tool calls are parsed from. Formats:

- deepseek-r1: the output is reasoning until `</think>` (its chat template opens the block in
  the prompt, so the output may lack `<think>`); with no `</think>` at all, all of it is
  reasoning.
- gpt-oss: OpenAI Harmony's channels (server/harmony.py): the analysis channel is the
  reasoning, the final channel the answer, messages to functions the tool calls; chosen by
  default where the chat template writes `<|channel|>`.
- qwen3: the same where the output opens with `<think>` or the prompt left a block open (the
  template of Qwen3's 2507 thinking models, or continue_final_message after "<think>");
  otherwise all of it is the answer (thinking switched off, e.g. chat_template_kwargs
  {"enable_thinking": false}). A stream cannot take back an answer it sent, so this is decided
  by the prompt and the output's opening, never by a later tag.

Per request (`plan_split`): an output that starts inside a block the prompt opened is reasoning
until `</think>` for both formats; a constrained output whose grammar applies from its first
token (no gate, below) is all answer.

The reasoning is stripped of surrounding whitespace and the answer of leading whitespace. A
stream holds back what may still turn out to be a tag or such whitespace, so the deltas joined
equal the finished split.

A grammar (response_format, a forced tool call) constrains the answer only: `reasoning_gate`
gives the scheduler's matcher the tags' token ids and whether the output starts inside a
block (scheduler/grammar/matcher.py). That needs each tag to be one token (it is for Qwen3 and
DeepSeek-R1); otherwise the grammar constrains the output from its first token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.core.sampling_params import GATE_THINKING, GATE_UNDECIDED
from radixserve.server.harmony import CALL, MARKERS, split_harmony
from radixserve.server.partial_text import held_back

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    # the output thinks unless it says otherwise: no </think> means all of it is reasoning
    thinks_by_default: bool
    start: str = THINK_START
    end: str = THINK_END
    harmony: bool = False  # gpt-oss's channels (server/harmony.py), not a <think> block

    @property
    def tags(self) -> tuple[str, ...]:
        """The texts the output must keep to be split (where they are special tokens)."""
        if self.harmony:
            return MARKERS
        return self.start, self.end


FORMATS = {"deepseek-r1": ReasoningFormat("deepseek-r1", thinks_by_default=True),
           "qwen3": ReasoningFormat("qwen3", thinks_by_default=False),
           "gpt-oss": ReasoningFormat("gpt-oss", thinks_by_default=False,
                                      start="<|channel|>analysis", end="<|end|>", harmony=True)}
# vLLM spells them with underscores; GLM-4.5 / 4.6 / 4.7 think as Qwen3 does (SGLang's and
# vLLM's glm45), and so does MiniMax-M2 (its template opens the block in the prompt)
ALIASES = {"deepseek_r1": "deepseek-r1", "glm45": "qwen3", "openai_gptoss": "gpt-oss",
           "gpt_oss": "gpt-oss", "minimax_m2": "qwen3", "minimax-m2": "qwen3",
           # Nemotron-3's template opens the block in the prompt when thinking is on and
           # writes it closed when off: qwen3's reading of the prompt
           "nano_v3": "qwen3", "nemotron_v3": "qwen3"}


def get_format(name: str) -> ReasoningFormat:
    name = ALIASES.get(name, name)
    if name not in FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(FORMATS)})")
    return FORMATS[name]


def reasoning_format(name: str | None, tokenizer: Any) -> ReasoningFormat | None:
    """The server's format: the one named, else gpt-oss's where the tokenizer's chat template
    writes Harmony channels (its raw output is no answer), else none."""
    if name:
        return get_format(name)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "<|channel|>" in template:
        return FORMATS["gpt-oss"]
    return None


@dataclass(frozen=True)
class ReasoningSplit:
    """How one request's output is split: its format, and whether the prompt left a block
    open (the output then starts inside it)."""
    fmt: ReasoningFormat
    inside: bool = False
    keep_calls: bool = True  # gpt-oss: the request parses tool calls (harmony.split_harmony)
    call_token: int | None = None  # gpt-oss: the id of <|call|> (harmony.with_call_end)
    forced_call: bool = False  # gpt-oss: a grammar forces the call (harmony.with_call_end)


def prompt_block(fmt: ReasoningFormat, prompt: str) -> str | None:
    """What the prompt's last tag did: "opened" or "closed" a block, None without tags."""
    last_start, last_end = prompt.rfind(fmt.start), prompt.rfind(fmt.end)
    if last_start == last_end:  # both -1
        return None
    return "opened" if last_start > last_end else "closed"


def plan_split(fmt: ReasoningFormat | None, prompt: str, constrained: bool,
               gate: tuple[int, int, str] | None, parses_calls: bool = True,
               tokenizer: Any = None, forced_call: bool = False) -> ReasoningSplit | None:
    """The split of a chat request's output: None without a parser, and for a constrained
    request whose grammar has no gate (it applies from the first token, so nothing of the
    output is reasoning)."""
    if fmt is None or (constrained and gate is None and not fmt.harmony):
        return None
    call_token = None
    if fmt.harmony and tokenizer is not None:
        call_token = _single_token(tokenizer, CALL)
    return ReasoningSplit(fmt, prompt_block(fmt, prompt) == "opened", parses_calls, call_token,
                          forced_call)


def split_reasoning(fmt: ReasoningFormat, text: str, final: bool = True,
                    inside: bool = False, keep_calls: bool = True) -> tuple[str | None, str]:
    """(reasoning or None, answer) of an output so far; `inside`: the prompt opened the block.
    Not final: only what can no longer change (a stream's deltas are the growth of both
    between calls)."""
    if fmt.harmony:
        return split_harmony(text, final, keep_calls)
    body = text.lstrip()
    opened = inside or body.startswith(fmt.start)
    if body.startswith(fmt.start):
        body = body[len(fmt.start):]
    elif not final and fmt.start.startswith(body):
        return None, ""  # nothing yet, or what may still become the opening tag
    if not (opened or fmt.thinks_by_default):
        return None, text  # no reasoning block: all of it is the answer
    end = body.find(fmt.end)
    if end >= 0:
        return body[:end].strip(), body[end + len(fmt.end):].lstrip()
    if final:
        return body.strip(), ""
    held = held_back(body, fmt.end)
    return body[:len(body) - held].strip(), ""


class ReasoningStream:
    """Deltas of one streamed output: `update(text, final)` -> (reasoning delta, the answer
    so far), the answer whole so that a tool-call stream can take it as it takes text."""

    def __init__(self, split: ReasoningSplit) -> None:
        self.split = split
        self.reasoning_sent = 0

    def update(self, text: str, final: bool = False) -> tuple[str, str]:
        reasoning, answer = split_reasoning(self.split.fmt, text, final, self.split.inside,
                                            self.split.keep_calls)
        reasoning = reasoning or ""
        delta = reasoning[self.reasoning_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        return delta, answer


def _single_token(tokenizer: Any, tag: str) -> int | None:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def reasoning_gate(fmt: ReasoningFormat, tokenizer: Any,
                   prompt: str) -> tuple[int, int, str] | None:
    """(start tag's id, end tag's id, initial state) for a constrained request's matcher, or
    None when the grammar applies from the first token: a tag is not one token, or the prompt
    closed the last block it opened (thinking switched off in the template). A prompt that
    opened a block starts the output in it; with neither, the format decides (deepseek-r1
    thinks, qwen3's first token decides). The prompt is read as text, as `plan_split` reads
    it: a tag of one token is in the text where its token is in the ids. gpt-oss's channels
    have no gate (the grammar applies from the first token)."""
    if fmt.harmony:
        return None
    start_id, end_id = _single_token(tokenizer, fmt.start), _single_token(tokenizer, fmt.end)
    if start_id is None or end_id is None:
        return None
    block = prompt_block(fmt, prompt)
    if block == "closed":
        return None
    if block == "opened" or fmt.thinks_by_default:
        return start_id, end_id, GATE_THINKING
    return start_id, end_id, GATE_UNDECIDED
