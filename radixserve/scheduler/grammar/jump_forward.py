"""Jump-forward (SGLang's compressed-FSM idea): when the grammar allows exactly one
continuation for the next characters (`{"name": "` after `{`, a fixed key, a closing `"}`),
those characters are appended as tokens at once, without a forward pass each; the request
then computes their KV in one extend, as a retracted request does, and samples on from there.

Token boundaries: the forced text is tokenized together with the last sampled token when that
token has not been sent yet and decodes to whole characters, so `"` then `name` can become
`"name` as a tokenizer would write it; the last token is replaced when the joint tokenization
starts differently. Any tokenization the matcher refuses falls back to the forced text alone,
and if the matcher refuses that too nothing is appended.

The tokens may differ from those plain constrained decoding would sample (the model might have
written the forced text in other tokens), so outputs can differ: jump-forward is a flag
(`--enable-jump-forward`), off by default."""
from __future__ import annotations

from typing import Any, NamedTuple

from radixserve.core.req import Req

_REPLACEMENT_CHAR = "\ufffd"


class Jump(NamedTuple):
    drop_last: bool  # the last output token is replaced
    token_ids: list[int]  # appended after it (or in its place)


def plan_jump(req: Req, tokenizer: Any) -> Jump | None:
    """The tokens to append for the grammar's forced text, checked against the matcher and
    accepted by it; None when nothing is forced or the matcher refuses every tokenization."""
    grammar = req.grammar
    if grammar is None:
        return None
    forced = grammar.forced_text()
    if not forced:
        return None
    last = req.output_ids[-1] if req.output_ids else None
    if last is not None and req.sent_output_len < len(req.output_ids):
        last_text = tokenizer.decode([last])
        if last_text and _REPLACEMENT_CHAR not in last_text:
            joint = tokenizer.encode(last_text + forced, add_special_tokens=False)
            if joint and joint[0] == last:
                if grammar.accept_all(joint[1:]):
                    return Jump(False, joint[1:])
            elif joint:
                grammar.rollback(1)
                if grammar.accept_all(joint):
                    return Jump(True, joint)
                if not grammar.accept(last):  # restore the state before the attempt
                    raise RuntimeError("grammar refused a token it had accepted")
    alone = tokenizer.encode(forced, add_special_tokens=False)
    if alone and grammar.accept_all(alone):
        return Jump(False, alone)
    return None


def apply_jump(req: Req, jump: Jump, max_tokens: int) -> int:
    """Append the jump's tokens to the request's output (at most `max_tokens` past what it
    had, the request's length budget; a grammar that was fed more is rolled back to match).
    Returns how many output tokens now lack KV beyond the usual last one (0: no extend
    needed)."""
    assert req.grammar is not None
    tokens = jump.token_ids
    budget = max_tokens + (1 if jump.drop_last else 0)
    if len(tokens) > budget:
        req.grammar.rollback(len(tokens) - budget)
        tokens = tokens[:budget]
    if jump.drop_last:
        req.output_ids.pop()
    req.output_ids.extend(tokens)
    return len(tokens) - (1 if jump.drop_last else 0)
