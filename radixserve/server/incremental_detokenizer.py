"""Incremental detokenization of one request's output tokens.

Text is emitted only once it is stable (the prefix_offset / read_offset scheme of HF TGI and
vLLM): each step decodes a short window of ids twice, `ids[prefix_offset:read_offset]` (already
emitted) and `ids[prefix_offset:]`, and emits the difference unless it ends in U+FFFD, the mark of
a UTF-8 character whose bytes have not all arrived yet. Decoding a window rather than a single
token keeps merges (leading spaces, multi-byte characters) right.

Stop strings: text that could be the start of a stop string is held back until it can no longer
become one, so a stop string is never streamed, even in part. On a stop-string finish the text is
cut where the stop string begins (the stop string itself is not returned, as OpenAI does); on a
stop-token finish (EOS, stop_token_ids) that last token's text is left out, as vLLM leaves it
out. `include_stop` (vLLM's include_stop_str_in_output) keeps both.

Special tokens kept (`keep_special_tokens`, the chat handler's tool-call marker when it is a
special token): the other special tokens' ids are dropped as they arrive and the rest is decoded
with skip_special_tokens=False, so the text holds the kept tokens and no EOS or other control
token.

Invariant: the concatenation of everything `append` and `finish` return equals
`tokenizer.decode(all_ids, ...)` (of the ids kept), cut at the stop string when one matched,
less the stop token when one matched.
"""
from __future__ import annotations

from typing import Any, Protocol

from radixserve.server.tokenizer_utils import dropped_special_ids

REPLACEMENT_CHAR = "\ufffd"


def stop_match(finish_reason: dict[str, Any] | None) -> int | str | None:
    """The stop string or stop token id a finished request's reason says it matched."""
    if finish_reason is None or finish_reason.get("type") != "stop":
        return None
    matched = finish_reason.get("matched")
    return matched if isinstance(matched, (int, str)) and not isinstance(matched, bool) \
        else None


class Decoder(Protocol):
    def decode(self, ids: list[int], **kwargs: Any) -> str: ...


class IncrementalDetokenizer:
    """Per-request state. Not thread-safe; one instance per request id."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True,
                 stop_strs: list[str] | None = None,
                 keep_special_tokens: tuple[str, ...] = (), include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        # with kept special tokens: the ids left out before decoding without skipping
        self.dropped: frozenset[int] | None = None
        if skip_special_tokens and keep_special_tokens:
            self.dropped = dropped_special_ids(tokenizer, keep_special_tokens)
            self.skip_special_tokens = False
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop_strs = [s for s in (stop_strs or []) if s]
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # ids[:read_offset] are reflected in self.text
        self.text = ""  # stable text of ids[:read_offset]
        self.sent_len = 0  # characters of self.text already returned
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)

    def append(self, new_ids: list[int]) -> str:
        """Add tokens; return the newly stable text (possibly empty)."""
        if self.finished:
            raise RuntimeError("append() after finish()")
        new_ids = self._kept(new_ids)
        if not new_ids:
            return ""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset:])
        if len(window_text) > len(prefix_text) and not window_text.endswith(REPLACEMENT_CHAR):
            self.text += window_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release(hold_stop_prefix=True)

    def finish(self, new_ids: list[int] | None = None,
               matched: int | str | None = None) -> str:
        """Add the last tokens and flush everything left (incomplete characters included), cut
        at the stop string (`matched`: str) or without the stop token (`matched`: its id, the
        last of the ids). Pass the finishing tokens here rather than to `append`, so that text
        past a stop string is never released."""
        if self.finished:
            return ""
        self.finished = True
        last = list(new_ids or [])
        if isinstance(matched, int) and not self.include_stop and last and last[-1] == matched:
            last.pop()
        self.ids.extend(self._kept(last))
        full_text = self._decode(self.ids)
        if full_text.startswith(self.text):
            self.text = full_text
        else:  # decode is not prefix-stable for this tokenizer here; keep what was emitted
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset:])[len(prefix_text):]
        if isinstance(matched, str) and matched:
            self.text = self.text[:self._stop_cut(matched)]
        return self._release(hold_stop_prefix=False)

    def _kept(self, ids: list[int]) -> list[int]:
        if self.dropped is None:
            return ids
        return [i for i in ids if i not in self.dropped]

    def _stop_cut(self, stop: str) -> int:
        """Where the text ends: at the stop string's start (or its end, include_stop).
        Held-back text means the match starts at or after sent_len; anything earlier was
        already sent and cannot be taken back."""
        index = self.text.find(stop, self.sent_len)
        if index < 0:
            index = self.text.rfind(stop)
        if index < 0:
            return len(self.text)
        if self.include_stop:
            return max(index + len(stop), self.sent_len)
        return max(index, self.sent_len)

    def _release(self, hold_stop_prefix: bool) -> str:
        end = len(self.text)
        if hold_stop_prefix and self.stop_strs:
            end -= self._stop_prefix_len(self.text[self.sent_len:])
        delta = self.text[self.sent_len:end]
        self.sent_len = end
        return delta

    def _stop_prefix_len(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that could begin a stop string (a complete
        stop string counts too: the scheduler will finish the request on it)."""
        longest = 0
        for stop in self.stop_strs:
            for k in range(min(len(stop), len(pending)), longest, -1):
                if pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest
