"""One request's grammar state: an xgrammar GrammarMatcher over its output tokens.

Invariant: the matcher has accepted exactly the request's `output_ids` (the scheduler feeds it
each token as it is appended). Retraction keeps a request's output ids, so its matcher stays
valid across a retraction and nothing is replayed; `replay` rebuilds the state from scratch
where that is needed (a request whose output was edited)."""
from __future__ import annotations

from typing import Any

import torch


class RequestGrammar:
    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self._compiled = compiled
        self._matcher = xgrammar.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    def accept_all(self, token_ids: list[int]) -> bool:
        """Accept every token or none (rolled back on the first refusal)."""
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
        return self.accept_all(token_ids)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an xgrammar bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def forced_text(self) -> str:
        """The text the grammar allows as the only continuation from here ('' if none)."""
        return self._matcher.find_jump_forward_string()

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
