"""One request's grammar state: an xgrammar GrammarMatcher over its output tokens.

Invariant: the matcher has accepted exactly the request's `output_ids` (the scheduler feeds it
each token as it is appended), past its reasoning where a `ReasoningGate` holds the grammar
back. Retraction keeps a request's output ids, so its matcher stays valid across a retraction
and nothing is replayed; `replay` rebuilds the state from scratch where that is needed (a
request whose output was edited).

A thinking model (--reasoning-parser) writes `<think> ... </think>` before the answer the
grammar describes, as vLLM's structured outputs with reasoning: while the gate is "thinking"
every token is allowed and none reaches the matcher, and the end tag's token opens the
grammar. "undecided" (Qwen3 with nothing in the prompt): the first token may open a block (the
start tag's token is allowed beside the grammar's tokens) or is the answer's first token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixserve.core.sampling_params import GATE_ANSWER, GATE_THINKING, GATE_UNDECIDED


THINKING, UNDECIDED, ANSWER = GATE_THINKING, GATE_UNDECIDED, GATE_ANSWER


@dataclass(frozen=True)
class ReasoningGate:
    start_id: int  # the token of <think>
    end_id: int    # the token of </think>
    initial: str   # THINKING, UNDECIDED or ANSWER (the prompt closed the block)

    def after(self, state: str, token_id: int) -> str:
        """The state after one output token."""
        if state == THINKING:
            return ANSWER if token_id == self.end_id else THINKING
        if state == UNDECIDED:
            return THINKING if token_id == self.start_id else ANSWER
        return ANSWER


class RequestGrammar:
    def __init__(self, compiled: Any, gate: ReasoningGate | None = None) -> None:
        import xgrammar

        self._compiled = compiled
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self.gate = gate
        self.state = gate.initial if gate is not None else ANSWER
        self.fed_last = False  # the last accepted token went to the matcher

    @property
    def active(self) -> bool:
        """The grammar constrains the next token (no reasoning in the way)."""
        return self.state == ANSWER

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it."""
        previous = self.state
        if previous != ANSWER:
            assert self.gate is not None
            self.state = self.gate.after(previous, token_id)
        # the answer's tokens, its first one too where the gate was undecided
        self.fed_last = self.state == ANSWER and previous != THINKING
        return bool(self._matcher.accept_token(token_id)) if self.fed_last else True

    def accept_all(self, token_ids: list[int]) -> bool:
        """Accept every token or none (the matcher rolled back on the first refusal); only
        while the grammar is active (jump-forward's text)."""
        assert self.active
        for n, token_id in enumerate(token_ids):
            if not self._matcher.accept_token(token_id):
                if n:
                    self._matcher.rollback(n)
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def replay(self, token_ids: list[int]) -> bool:
        """Reset to the start and accept `token_ids` (False if the grammar refuses them)."""
        self._matcher.reset()
        self.state = self.gate.initial if self.gate is not None else ANSWER
        return all(self.accept(token_id) for token_id in token_ids)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an xgrammar bitmask (left as it is,
        all allowed, while the model thinks)."""
        if self.state == THINKING:
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self.state == UNDECIDED:  # or it opens a block
            assert self.gate is not None
            word, bit = divmod(self.gate.start_id, 32)
            if word < bitmask.shape[1]:
                value = int(bitmask[row, word]) | (1 << bit)
                bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def forced_text(self) -> str:
        """The text the grammar allows as the only continuation from here ('' if none)."""
        return self._matcher.find_jump_forward_string() if self.active else ""

    @property
    def terminated(self) -> bool:
        return self.active and bool(self._matcher.is_terminated())
