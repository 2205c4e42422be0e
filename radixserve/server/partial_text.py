"""Reading output text that is still being generated: how much of its end may yet become a
tag (held back from a stream until it cannot), and blanks skipped between tags."""
from __future__ import annotations


def held_back(text: str, *tags: str) -> int:
    """How many trailing characters of `text` could be the start of one of `tags`."""
    longest = max((len(tag) for tag in tags), default=1)
    for size in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-size:]
        if any(tag.startswith(tail) for tag in tags):
            return size
    return 0


def skip_blanks(text: str, pos: int) -> int:
    """The first position from `pos` on that is not whitespace (len(text) if none)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
