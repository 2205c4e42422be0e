"""The front ends' grammar check: an invalid regex, JSON schema or EBNF is the caller's error
(HTTP 400 naming the field), found before the request reaches the scheduler.

Parsing a grammar without the tokenizer (xgrammar.Grammar.from_*) is fast (well under a
millisecond for usual schemas) and catches what compilation would refuse; the scheduler
compiles with the tokenizer in its worker threads afterwards. A parse that takes longer than
CHECK_TIMEOUT_S is refused (400), without waiting for it to end.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError

from radixserve.core.sampling_params import InvalidRequestError, SamplingParams

# how every JSON schema is compiled: compact separators (", " and ": ") rather than any
# whitespace, which small models can fill forever; strict: no properties the schema does
# not list unless it says additionalProperties
JSON_SCHEMA_OPTIONS = {"any_whitespace": False, "strict_mode": True}
_MAX_MESSAGE_CHARS = 300


# A grammar that takes xgrammar long to parse (a string pattern like ^.{0,4000}$ takes ~5 s,
# arrays nested 500 deep ~5 s, 1,000 deep ~90 s; it cannot be interrupted) is refused after
# CHECK_TIMEOUT_S; its parse goes on in a daemon thread, and at most MAX_CHECKS_RUNNING run at
# once (a grammar asked for again while its parse runs waits for that one)
CHECK_TIMEOUT_S = 10.0
MAX_CHECKS_RUNNING = 4
_RESULTS_KEPT = 256


class _Checks:
    """Grammar parses in daemon threads, their results kept (LRU) and shared in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.results: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        self.running: dict[tuple[str, str], Future[str | None]] = {}

    def error(self, kind: str, text: str, timeout_s: float) -> str | None:
        key = (kind, text)
        with self.lock:
            if key in self.results:
                self.results.move_to_end(key)
                return self.results[key]
            future = self.running.get(key)
            if future is None:
                if len(self.running) >= MAX_CHECKS_RUNNING:
                    return (f"{MAX_CHECKS_RUNNING} other grammars are still being checked "
                            "(each for up to the limit); retry later")
                future = self.running[key] = Future()
                threading.Thread(target=self._run, args=(key, future), daemon=True,
                                 name="grammar-check").start()
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            return (f"checking it took more than {timeout_s:g} s (xgrammar's parse of this "
                    "grammar is too slow): simplify it")

    def _run(self, key: tuple[str, str], future: Future[str | None]) -> None:
        error = _parse_error(*key)
        with self.lock:
            self.results[key] = error
            while len(self.results) > _RESULTS_KEPT:
                self.results.popitem(last=False)
            del self.running[key]
        future.set_result(error)


_CHECKS = _Checks()


def grammar_error(kind: str, text: str, timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """None when `text` is a valid grammar of `kind`, else a message saying what is wrong
    (or that checking it took longer than `timeout_s`)."""
    return _CHECKS.error(kind, text, timeout_s)


def _parse_error(kind: str, text: str) -> str | None:
    import xgrammar

    try:
        if kind == "json_schema":
            xgrammar.Grammar.from_json_schema(text, **JSON_SCHEMA_OPTIONS)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgrammar.Grammar.from_ebnf(text)
        else:
            return f"unknown grammar kind {kind!r}"
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/...
        return _clean(str(exc))
    return None


def _clean(message: str) -> str:
    """xgrammar's messages start with a timestamp and a source path: keep what follows."""
    line = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    if "] " in line and line.startswith("["):
        line = line.split("] ", 1)[1]
    if ".cc:" in line and ": " in line:
        line = line.split(": ", 1)[1]
    # the failed assertion's own text says nothing to the client: "Check failed: (cond) is
    # false: Failed to parse JSON: ..." keeps what follows
    line = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", line)
    return line[:_MAX_MESSAGE_CHARS]


def check_grammar(params: SamplingParams, has_tokenizer: bool = True) -> None:
    """Raise InvalidRequestError(param=kind) when the request's grammar is invalid, or when
    there is no tokenizer to constrain with. Call after params.normalize()."""
    key = params.grammar_key
    if key is None:
        return
    kind, text = key
    if not has_tokenizer:
        raise InvalidRequestError(f"{kind} needs a tokenizer; the server runs with "
                                  "--skip-tokenizer-init", param=kind)
    error = grammar_error(kind, text)
    if error is not None:
        raise InvalidRequestError(f"invalid {kind}: {error}", param=kind)
