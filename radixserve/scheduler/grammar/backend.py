"""Grammar compilation off the scheduler's critical path.

`GrammarBackend.request(kind, text)` returns a Future of the compiled grammar at once: a cache
keyed by (kind, text) holds every grammar asked for (in flight or done; the least recently used
dropped past `cache_size` grammars or `cache_bytes` of compiled ones, as xgrammar sizes them),
and compilation runs in two worker threads (a slow grammar holds up one of them). xgrammar's
own compiler cache is off: it has no bound by default, and a server asked for ever new schemas
(tools, per-request JSON schemas) would grow without end (~80 KB for a small schema). The
scheduler keeps a request in the queue, skipped by admission, until its future is done (or
past the manager's COMPILE_TIMEOUT_S); other requests are admitted meanwhile. xgrammar's
compiler releases the GIL while it works.

The tokenizer's vocabulary is converted for xgrammar (TokenizerInfo) once, in the worker
thread, on the first grammar request: a server that is never asked for a grammar pays nothing.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from radixserve.config import grammar_cache_mb
from radixserve.scheduler.grammar.matcher import ReasoningGate, RequestGrammar
from radixserve.scheduler.grammar.validation import JSON_SCHEMA_OPTIONS

logger = logging.getLogger(__name__)
GrammarKey = tuple[str, str]  # (kind, text): ("regex" | "json_schema" | "ebnf", grammar)


class GrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = 512, compile_threads: int = 2,
                 cache_bytes: int | None = None) -> None:
        """`vocab_size`: the model's (its logits' width; the tokenizer's may be smaller).
        `stop_token_ids`: what ends a request (EOS): allowed once the grammar is complete.
        `cache_bytes`: the bound on compiled grammars kept (None: RADIXSERVE_GRAMMAR_CACHE_MB,
        config.grammar_cache_mb; -1: none, the count alone, which evicts alike on every
        tensor-parallel rank)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[GrammarKey, Future[Any]] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = int(grammar_cache_mb() * 2 ** 20) if cache_bytes is None \
            else cache_bytes
        self._lock = threading.Lock()  # the cache is touched by the scheduler thread only,
        # the compiler is built by the worker: the lock guards the compiler's creation
        self._executor = ThreadPoolExecutor(max_workers=compile_threads,
                                            thread_name_prefix="grammar-compile")

    def request(self, key: GrammarKey) -> Future[Any]:
        """The compiled grammar of `key`, now or later (exceptions are the grammar's errors)."""
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        self._evict_for_one_more()
        future = self._executor.submit(self._compile, key)
        self._cache[key] = future
        return future

    def cached_bytes(self) -> int:
        """What the compiled grammars in the cache take (those still compiling count 0)."""
        return sum(_compiled_bytes(future) for future in self._cache.values())

    def _evict_for_one_more(self) -> None:
        """Drop the least recently used grammars until one more fits (a grammar's size is
        known once compiled, so the newest may pass the byte bound until the next request).
        Requests holding a dropped grammar's Future keep it."""
        sizes = [_compiled_bytes(future) if self._cache_bytes >= 0 else 0
                 for future in self._cache.values()]
        total, dropped = sum(sizes), 0
        while self._cache and (len(self._cache) >= self._cache_size
                               or total > self._cache_bytes >= 0):
            self._cache.popitem(last=False)
            total -= sizes[dropped]
            dropped += 1

    def new_matcher(self, compiled: Any, gate: ReasoningGate | None = None) -> RequestGrammar:
        return RequestGrammar(compiled, gate)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- worker thread ----
    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1,
                                                          cache_enabled=False)
                logger.info("grammar compiler ready (vocabulary of %d, stop tokens %s)",
                            self._vocab_size, self._stop_token_ids)
            return self._compiler

    def _compile(self, key: GrammarKey) -> Any:
        kind, text = key
        compiler = self._get_compiler()
        if kind == "json_schema":
            return compiler.compile_json_schema(text, **JSON_SCHEMA_OPTIONS)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        raise ValueError(f"unknown grammar kind {kind!r}")


def _compiled_bytes(future: Future[Any]) -> int:
    if not future.done() or future.cancelled() or future.exception() is not None:
        return 0
    return future.result().memory_size_bytes
