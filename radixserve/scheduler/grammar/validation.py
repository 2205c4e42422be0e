"""The front ends' grammar check: an invalid regex, JSON schema or EBNF is the caller's error
(HTTP 400 naming the field), found before the request reaches the scheduler.

Parsing a grammar without the tokenizer (xgrammar.Grammar.from_*) is fast (well under a
millisecond for usual schemas) and catches what compilation would refuse; the scheduler
compiles with the tokenizer in its worker thread afterwards.
"""
from __future__ import annotations

import functools

from radixserve.core.sampling_params import InvalidRequestError, SamplingParams

# how every JSON schema is compiled: compact separators (", " and ": ") rather than any
# whitespace, which small models can fill forever; strict: no properties the schema does
# not list unless it says additionalProperties
JSON_SCHEMA_OPTIONS = {"any_whitespace": False, "strict_mode": True}
_MAX_MESSAGE_CHARS = 300


def grammar_error(kind: str, text: str) -> str | None:
    """None when `text` is a valid grammar of `kind`, else a message saying what is wrong."""
    return _cached_error(kind, text)


@functools.lru_cache(maxsize=256)
def _cached_error(kind: str, text: str) -> str | None:
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
