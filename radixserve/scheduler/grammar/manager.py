"""The scheduler's grammar component: compiles each constrained request's grammar (through
the backend's cache and worker thread), gives the request its matcher when the grammar is
ready, advances the matcher by each token the request gets, and plans jump-forward.

Lifecycle of a constrained request:
  add_request  -> `on_add`: the grammar's Future is kept in `req.grammar_future`
  admission    -> `ready(req)`: False while compiling (the request is skipped, others go on);
                  True once `req.grammar` (a RequestGrammar) exists; a grammar that failed to
                  compile is put in `failed` for the scheduler to end (abort with the message)
  each token   -> `after_token(req)`: the matcher accepts it; with jump-forward, forced text
                  is appended and the number of tokens that still need KV is returned
With tensor parallelism every rank must admit alike, and each rank compiles on its own clock:
rank 0 decides (`replicated`). Before each turn it finds which grammars are compiled or past the
time limit (`poll`) and every rank applies that decision (`settle`) before admitting, a rank
whose own compile is still running waiting for it then; `ready` admits only settled grammars."""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

from radixserve.core.req import Req
from radixserve.scheduler.grammar.jump_forward import apply_jump, plan_jump
from radixserve.scheduler.grammar.matcher import ReasoningGate

logger = logging.getLogger(__name__)
# a request whose grammar has not compiled after this long ends with an error rather than wait
# on (xgrammar cannot stop a compile; the backend's other threads serve other grammars)
COMPILE_TIMEOUT_S = 60.0


class GrammarManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int],
                 context_len: int, jump_forward: bool = False, replicated: bool = False) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.context_len = context_len
        self.jump_forward = jump_forward
        self.replicated = replicated
        self._backend: Any = None
        self.failed: list[tuple[Req, str]] = []
        self.num_jumped_tokens = 0  # statistics: tokens appended by jump-forward

    @property
    def backend(self) -> Any:
        if self._backend is None:
            from radixserve.scheduler.grammar.backend import GrammarBackend
            # replicated: a byte bound would evict by each rank's compile progress (a size is
            # known once compiled), so ranks' caches, and then their waits, would differ
            self._backend = GrammarBackend(self.tokenizer, self.vocab_size,
                                           sorted(self.stop_token_ids),
                                           cache_bytes=-1 if self.replicated else None)
        return self._backend

    def on_add(self, req: Req) -> str | None:
        """Start compiling the request's grammar; an error message if it cannot have one."""
        key = req.sampling_params.grammar_key
        if key is None:
            return None
        if self.tokenizer is None:
            return f"{key[0]} needs a tokenizer; the server runs with --skip-tokenizer-init"
        req.grammar_future = self.backend.request(key)
        req.grammar_asked_at = time.monotonic()
        req.grammar_settled = False
        return None

    def ready(self, req: Req) -> bool:
        future = req.grammar_future
        if future is None:
            return True
        if self.replicated:
            if not req.grammar_settled:
                return False  # rank 0 has not seen it compiled yet
        elif not future.done():
            if self._late(req):
                self._give_up(req)
            return False
        req.grammar_future = None  # (a replicated rank still compiling waits for it here)
        try:
            gate = req.sampling_params.reasoning_gate
            req.grammar = self.backend.new_matcher(
                future.result(), ReasoningGate(*gate) if gate is not None else None)
        except Exception as exc:  # noqa: BLE001 - the grammar's own error, for the client
            kind = req.sampling_params.grammar_key[0]  # type: ignore[index]
            self.failed.append((req, f"invalid {kind}: {exc}"))
            return False
        if req.output_ids and not req.grammar.replay(req.output_ids):
            self.failed.append((req, "the grammar refuses the request's output so far"))
            return False
        return True

    @staticmethod
    def _late(req: Req) -> bool:
        return time.monotonic() - req.grammar_asked_at > COMPILE_TIMEOUT_S

    def _give_up(self, req: Req) -> None:
        req.grammar_future = None  # the compile goes on (and is cached) without it
        kind = req.sampling_params.grammar_key[0]  # type: ignore[index]
        self.failed.append((req, f"compiling the {kind} took more than "
                                 f"{COMPILE_TIMEOUT_S:g} s: simplify it"))

    def poll(self, reqs: list[Req]) -> tuple[list[str], list[str]] | None:
        """Rank 0 of a replicated scheduler: the rids of `reqs` whose grammar has compiled
        (or failed to) since the last poll, and of those past the time limit; None if none."""
        done, late = [], []
        for req in reqs:
            future = req.grammar_future
            if future is None or req.grammar_settled:
                continue
            if future.done():
                done.append(req.rid)
            elif self._late(req):
                late.append(req.rid)
        return (done, late) if done or late else None

    def settle(self, reqs: list[Req], done: list[str], late: list[str]) -> None:
        """Apply rank 0's `poll` on every rank: `done` are admissible (`ready`), `late` end."""
        done_rids, late_rids = set(done), set(late)
        for req in reqs:
            if req.grammar_future is None:
                continue
            if req.rid in done_rids:
                req.grammar_settled = True
            elif req.rid in late_rids:
                self._give_up(req)

    def wait_any(self, reqs: list[Req], timeout_s: float) -> None:
        """Block up to `timeout_s` until one of `reqs`' grammars is compiled (the scheduler has
        nothing else to do)."""
        pending = [r.grammar_future for r in reqs if r.grammar_future is not None]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def after_token(self, req: Req) -> int:
        """The request's last output token was just appended (and its finish checked): feed
        it to the matcher, then jump forward if allowed. Returns how many tokens were
        appended that need an extend pass (0: decode on as usual)."""
        grammar = req.grammar
        if grammar is None:
            return 0
        if not grammar.accept(req.output_ids[-1]):
            # the mask allowed only accepted tokens: this is a bug, not the client's fault
            logger.error("request %s: the grammar refused sampled token %d", req.rid,
                         req.output_ids[-1])
            return 0
        if (req.finished or not self.jump_forward or req.return_logprob
                or not grammar.fed_last or grammar.terminated):
            return 0  # (not fed_last: reasoning, or its end tag just now)
        budget = min(req.sampling_params.max_new_tokens - len(req.output_ids),
                     self.context_len - 1 - req.seqlen)
        if budget <= 0:
            return 0
        jump = plan_jump(req, self.tokenizer)
        if jump is None:
            return 0
        appended = apply_jump(req, jump, budget)
        self.num_jumped_tokens += max(appended, 0)
        return appended
