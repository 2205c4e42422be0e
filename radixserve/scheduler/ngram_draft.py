"""N-gram drafts for speculative decoding (prompt lookup, vLLM's `ngram` method, SGLang's
NGRAM): the tokens that followed the latest earlier occurrence of the sequence's own last
n tokens are guessed to come next. Free to make (no draft model), and right often wherever
the answer copies its context: code edits, retrieval answers, summaries that quote.

The match: the longest n in [min_match, max_match] whose last-n-token suffix occurs earlier
in prompt + output (ties to the latest occurrence), then the `num_draft` tokens after it
(where those run past the sequence's end, the repeat the match implies goes on).
Each request keeps a growing numpy copy of its tokens (`Req.draft_tokens`), so a step costs
a vectorised scan of its sequence, not a Python loop or a list-to-array copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radixserve.core.req import Req


@dataclass
class _TokenBuffer:
    """A request's prompt + output ids as int64, grown by doubling."""
    ids: np.ndarray
    length: int

    @classmethod
    def of(cls, tokens: list[int]) -> "_TokenBuffer":
        ids = np.empty(max(2 * len(tokens), 64), dtype=np.int64)
        ids[:len(tokens)] = tokens
        return cls(ids, len(tokens))

    def sync(self, req: Req) -> np.ndarray:
        """The request's tokens so far (its outputs appended since the last call)."""
        total = len(req.origin_input_ids) + len(req.output_ids)
        if total > self.length:
            new = req.output_ids[self.length - len(req.origin_input_ids):]
            if total > len(self.ids):
                grown = np.empty(2 * total, dtype=np.int64)
                grown[:self.length] = self.ids[:self.length]
                self.ids = grown
            self.ids[self.length:total] = new
            self.length = total
        return self.ids[:self.length]


def propose_from(tokens: np.ndarray, num_draft: int, min_match: int, max_match: int
                 ) -> list[int]:
    """Up to `num_draft` tokens that followed the latest earlier occurrence of the longest
    suffix of `tokens` of min_match..max_match tokens; [] when none occurs."""
    length = len(tokens)
    if num_draft < 1 or length < min_match + 1:
        return []
    # ends: positions e < length - 1 where an occurrence of the suffix could end
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)
    for back in range(1, max_match):  # grow every candidate's match one token leftwards
        alive = np.flatnonzero(matched == back)
        if alive.size == 0:
            break
        starts = ends[alive] - back
        ok = starts >= 0
        alive, starts = alive[ok], starts[ok]
        same = tokens[starts] == tokens[length - 1 - back]
        matched[alive[same]] += 1
    best = int(matched.max())
    if best < min_match:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]])  # the latest of the longest
    draft = tokens[end + 1:end + 1 + num_draft].tolist()
    # a match that reaches into the suffix (a run, a short cycle) predicts the sequence
    # repeats with period length - 1 - end: its continuation past the end goes on so
    period = length - 1 - end
    while len(draft) < num_draft:
        draft.append(draft[len(draft) - period])
    return draft


class NgramProposer:
    """Drafts for each running request (see the module docstring)."""

    def __init__(self, num_draft: int, min_match: int, max_match: int) -> None:
        if num_draft < 1:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 1, got {num_draft}")
        if not 1 <= min_match <= max_match:
            raise ValueError("the n-gram match window needs 1 <= min <= max, got "
                             f"{min_match}..{max_match}")
        self.num_draft = num_draft
        self.min_match = min_match
        self.max_match = max_match

    def propose(self, req: Req, limit: int) -> list[int]:
        """At most min(limit, num_draft) drafts for `req` to verify in its next step."""
        if limit < 1:
            return []
        buffer = req.draft_tokens
        if not isinstance(buffer, _TokenBuffer):
            buffer = req.draft_tokens = _TokenBuffer.of(req.all_ids())
        return propose_from(buffer.sync(req), min(limit, self.num_draft), self.min_match,
                            self.max_match)
