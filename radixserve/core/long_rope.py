"""LongRoPE (`rope_type: longrope`, Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): two rope tables
and the rule that picks one per request.

The checkpoints carry two sets of frequency factors. transformers rotates a sequence of L
tokens with the short factors while L <= `original_max_position_embeddings` and with the long
ones past it, for every position of the sequence; when generation first carries a sequence
past that length, Phi-3's `prepare_inputs_for_generation` drops the KV cache and computes the
whole sequence again with the long factors. The same rule here, per request:

- the rotary tables hold the short rows [0, P) and the long rows [P, 2P) (P: the positions
  the tables cover); a request on the long table shifts its rope positions by P
  (`Req.rope_table_shift`, carried to the pass as a position offset);
- a request starts on the long table when its prompt is longer than the original context;
- a request on the short table whose next token would make it longer goes back to the queue
  with its KV cached, and is prefilled again on the long table (as jump-forward requeues);
- the prefix cache keeps the two tables' KV apart (`Req.cache_key`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LongRopeSwitch:
    original_positions: int  # original_max_position_embeddings: the short table's reach
    long_table_row: int  # the long table's first row in the rotary tables (P)

    @classmethod
    def from_config(cls, config: Any) -> "LongRopeSwitch | None":
        """The switch of a `longrope` model (a ModelConfig), None for any other rope."""
        if config.rope_type != "longrope":
            return None
        original = config.rope_parameters.get("original_max_position_embeddings") or \
            getattr(config.hf, "original_max_position_embeddings", None)
        if not original:
            raise ValueError("rope_type 'longrope' needs original_max_position_embeddings")
        return cls(int(original), config.rope_positions)

    def wants_long(self, length: int) -> bool:
        """True when a sequence of `length` tokens is rotated with the long factors."""
        return length > self.original_positions

    def place(self, req: Any) -> None:
        """Put a request (waiting, with no KV) on the table its length asks for."""
        if self.wants_long(req.seqlen):
            req.use_rope_table(self.long_table_row)

    def due(self, req: Any, ahead: int = 0) -> bool:
        """True when a request on the short table must move to the long one before its next
        pass: its length (after `ahead` more tokens) passes the original context."""
        return not req.rope_table_shift and self.wants_long(req.seqlen + ahead)

    def draft_room(self, req: Any) -> int:
        """Speculative decoding: the most draft tokens a request's verify pass may carry and
        stay within its table (a short-table request must not pass the original context)."""
        if req.rope_table_shift:
            return 1 << 30
        return max(self.original_positions - req.seqlen, 0)


def place_on_rope_table(switch: LongRopeSwitch | None, req: Any) -> None:
    """`switch.place(req)` where the model has LongRoPE's tables."""
    if switch is not None:
        switch.place(req)


def long_rope_due(switch: LongRopeSwitch | None, req: Any, ahead: int = 0) -> bool:
    """`switch.due(req, ahead)`; False without LongRoPE."""
    return switch is not None and switch.due(req, ahead)
