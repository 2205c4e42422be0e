"""TokenizerManager: the asyncio side of the server (runs in the HTTP process).

It validates and tokenizes requests, sends them to the scheduler, folds the detokenizer's
BatchStrOut pieces into per-request state, and hands snapshots back to the API handlers.

Ownership: a request's ReqState exists from `_send` until its final output was consumed or the
consumer went away; a consumer that leaves early (client disconnect, error, cancellation) aborts
the request in the scheduler, which frees its KV (or returns it to the radix cache).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections import deque
from dataclasses import replace
from typing import Any, AsyncIterator, Mapping

import zmq
import zmq.asyncio
from starlette.requests import Request

from radixserve.core.io_struct import (AbortReq, BatchStrOut, FlushCacheReply, FlushCacheReq,
                                       GetInternalStateReq, InternalState, LoRAUpdateReply,
                                       ReqError, SchedulerStateUpdate, TokenizedGenerateReq)
from radixserve.core.multimodal import ImageInput
from radixserve.core.req import FIRST_TOKEN_TIME_KEY
from radixserve.core.request_validation import RequestLimits, validate_request
from radixserve.core.sampling_params import (GRAMMAR_KINDS, MAX_N, InvalidRequestError,
                                             SamplingParams)
from radixserve.scheduler.grammar.validation import check_grammar
from radixserve.server.dp_router import DataParallelRouter
from radixserve.server.errors import APIError, ClientDisconnected
from radixserve.server.image_inputs import ImageOptions, image_reader
from radixserve.server.ipc import PortArgs, pull_socket, push_socket
from radixserve.server.metrics import ServerMetrics
from radixserve.server.request_lanes import RequestLanes
from radixserve.server.request_state import GenerateRequest, ReqOutput, ReqState
from radixserve.server.shared_prefix import WaitingCopies, plan_warmups
from radixserve.server.tokenizer_utils import token_texts

logger = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 60.0


class TokenizerManager:
    def __init__(self, port_args: PortArgs, tokenizer: Any | None, model_info: dict[str, Any],
                 metrics: ServerMetrics, log_requests: bool = False,
                 router: DataParallelRouter | None = None,
                 generation_defaults: dict[str, Any] | None = None,
                 image_options: ImageOptions = ImageOptions()) -> None:
        self.port_args = port_args
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.limits = RequestLimits.from_model_info(model_info)
        # a model that reads images: its image processor and placeholders (image_inputs.py)
        self.images = image_reader(model_info.get("vision"), image_options, tokenizer)
        # sampling parameters requests get when they leave them unset (the model's
        # generation_config.json, as vLLM does)
        self.generation_defaults = dict(generation_defaults or {})
        if self.generation_defaults:
            logger.info("default sampling parameters of the model: %s", self.generation_defaults)
        self.metrics = metrics
        self.log_requests = log_requests
        self.rid_to_state: dict[str, ReqState] = {}
        # copies of an n > 1 request not yet sent, while their prompt's prefix is cached first
        self.waiting = WaitingCopies()
        # (replica, future) of each control request awaiting its reply
        self.pending_replies: dict[type, deque[tuple[int, asyncio.Future[Any]]]] = {
            FlushCacheReply: deque(), InternalState: deque(), LoRAUpdateReply: deque()}
        # each replica's latest state sent unasked (SchedulerStateUpdate): the gauges of /metrics
        self.latest_states: dict[int, InternalState] = {}
        # one socket per data-parallel replica; the router picks one for each request
        self.router = router or DataParallelRouter(len(port_args.scheduler_inputs))
        self.send_socks: list[zmq.Socket] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        # set on shutdown or when a child process died: new requests are refused (503)
        self.refusing: str | None = None
        self.ended_by_failure = 0  # requests fail_all_threadsafe ended
        # request building, off the event loop (request_lanes.py)
        self.lanes = RequestLanes(tokenizer)
        self.recv_task: asyncio.Task[None] | None = None

    # ---- lifecycle (called inside the server's event loop) ----
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.sync_context = zmq.Context(1)
        self.async_context = zmq.asyncio.Context(1)
        self.send_socks = [push_socket(self.sync_context, address)
                           for address in self.port_args.scheduler_inputs]
        self.recv_sock = pull_socket(self.async_context, self.port_args.tokenizer_input)
        self.recv_task = asyncio.create_task(self._recv_loop(), name="tokenizer-manager-recv")

    async def stop(self) -> None:
        if self.recv_task is not None:
            self.recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.recv_task
        self.recv_sock.close(linger=0)
        for sock in self.send_socks:
            sock.close(linger=0)
        self.async_context.term()
        self.sync_context.term()
        self.lanes.shutdown()

    # ---- building requests ----
    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError("the server runs with --skip-tokenizer-init: send input_ids, not text")
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def make_request(self, *, text: str | None = None, input_ids: list[int] | None = None,
                     sampling_params: SamplingParams, rid: str | None = None,
                     return_logprob: bool = False, logprob_start_len: int = -1,
                     top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                     stream: bool = False, param: str = "prompt",
                     grammar_param: str | None = None,
                     field_names: Mapping[str, str] | None = None,
                     lora_name: str | None = None,
                     priority: int | None = None,
                     mm_inputs: list[ImageInput] | None = None) -> GenerateRequest:
        """Validate everything (core/request_validation.py, as the Engine does; a grammar's
        syntax too) and tokenize; raises APIError(400) for bad input (`grammar_param` names
        the field a bad grammar came from, when not the sampling parameter's own name;
        `field_names` maps sampling parameters to the API's names for them, in the error's
        param and message: max_new_tokens is OpenAI's max_tokens)."""
        if input_ids is None:
            if text is None:
                raise APIError("either text or input_ids must be given", param=param)
            if text == "":
                raise APIError("the prompt must not be empty", param=param)
            input_ids = self.tokenize(text)
        try:
            validate_request(input_ids, sampling_params, self.limits, logprob_start_len,
                             top_logprobs_num, lora_name, priority)
            check_grammar(sampling_params, has_tokenizer=self.tokenizer is not None)
        except InvalidRequestError as exc:
            field, message = param if exc.param == "prompt" else exc.param, str(exc)
            if grammar_param is not None and exc.param in GRAMMAR_KINDS:
                field = grammar_param  # e.g. response_format, which the grammar came from
                message = re.sub(rf"\b{exc.param}\b", grammar_param, message, count=1)
            for ours, theirs in (field_names or {}).items():
                message = re.sub(rf"\b{ours}\b", theirs, message)
                field = theirs if field == ours else field
            raise APIError(message, param=field) from exc
        if rid is not None and (rid in self.rid_to_state or rid in self.waiting):
            raise APIError(f"request id {rid!r} is already in use", param="rid")
        return GenerateRequest(
            rid=rid or uuid.uuid4().hex, input_ids=list(input_ids), input_text=text,
            sampling_params=sampling_params, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs, stream=stream,
            lora_name=lora_name, priority=priority, mm_inputs=mm_inputs)

    # ---- generation ----
    async def generate(self, req: GenerateRequest,
                       http_request: Request | None = None) -> AsyncIterator[ReqOutput]:
        """Outputs of one request: each streamed update if req.stream, always the final one."""
        aborted_while_waiting = self.waiting.sent(req.rid)
        state = self._send(req)
        if aborted_while_waiting:
            self.send_abort(req.rid)
        watcher = None if http_request is None else \
            asyncio.create_task(_watch_disconnect(http_request, state))
        try:
            while True:
                await self._wait(state)
                if state.error is not None:
                    raise APIError(state.error.message, status_code=state.error.http_status)
                if state.finished:
                    self._log_finish(state)
                    yield state.snapshot()
                    return
                if req.stream:
                    yield state.snapshot()
        finally:
            if watcher is not None:
                watcher.cancel()
            if not state.finished and (state.error is None or state.error.still_scheduled):
                self.abort(req.rid)
            self.rid_to_state.pop(req.rid, None)
            self.router.finished(req.rid)

    async def generate_final(self, req: GenerateRequest,
                             http_request: Request | None = None) -> ReqOutput:
        async with contextlib.aclosing(self.generate(replace(req, stream=False),
                                                     http_request)) as outputs:
            async for out in outputs:
                if out.finished:
                    return out
        raise RuntimeError("request ended without a final output")

    async def generate_all(self, reqs: list[GenerateRequest],
                           http_request: Request | None = None) -> list[ReqOutput]:
        """Final outputs of several requests; if one fails, the others are aborted."""
        await self.cache_shared_prefixes(reqs, http_request)
        tasks = [asyncio.create_task(self.generate_final(r, http_request)) for r in reqs]
        try:
            return list(await asyncio.gather(*tasks))
        except APIError as exc:
            self._uncount_if_refused(reqs, exc)
            raise
        finally:
            for task in tasks:
                task.cancel()
            self.waiting.forget(reqs)

    async def generate_merged(self, reqs: list[GenerateRequest], http_request: Request | None
                              ) -> AsyncIterator[tuple[int, ReqOutput]]:
        """Streamed updates of several requests, interleaved as they come: (index, output)."""
        if len(reqs) == 1:  # one stream (the common case): no pump task and queue per update
            async with contextlib.aclosing(self.generate(reqs[0], http_request)) as outputs:
                async for out in outputs:
                    yield 0, out
            return
        await self.cache_shared_prefixes(reqs, http_request)
        queue: asyncio.Queue[tuple[int, ReqOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, req: GenerateRequest) -> None:
            try:
                async with contextlib.aclosing(self.generate(req, http_request)) as outputs:
                    async for out in outputs:
                        await queue.put((index, out))
                await queue.put((index, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((index, exc))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    if isinstance(item, APIError):
                        self._uncount_if_refused(reqs, item)
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            self.waiting.forget(reqs)

    async def cache_shared_prefixes(self, reqs: list[GenerateRequest],
                                    http_request: Request | None) -> None:
        """Prefill each prompt `reqs` repeat once (shared_prefix.py); each copy stays known as
        waiting until `generate` sends it, and the caller forgets those never sent."""
        warmups = plan_warmups(reqs)
        if not warmups:
            return
        self.waiting.wait(reqs, warmups)
        started = time.perf_counter()
        try:
            await asyncio.gather(*(self.generate_final(w, http_request)
                                   for w in warmups.values()))
        except BaseException as exc:  # the client went, the server failed, or the prompt was
            self.waiting.forget(reqs)  # refused (queue full, ...): none is sent
            refused = isinstance(exc, APIError) and exc.status_code < 500
            for req in [] if refused else reqs:  # a refusal is no request, as for n = 1
                self.metrics.observe_finish("abort", len(req.input_ids), 0, 0,
                                            time.perf_counter() - started)
            raise

    def _uncount_if_refused(self, reqs: list[GenerateRequest], exc: APIError) -> None:
        """A request one of whose parts (a copy of n > 1, a prompt of a batch) was refused
        (a 4xx: the queue full, ...) is no request, as one refused alone: the parts still
        running are aborted as the error ends the request, without counting as aborts."""
        if exc.status_code < 500:
            for req in reqs:
                state = self.rid_to_state.get(req.rid)
                if state is not None:
                    state.counted = False

    def abort_by_client(self, rid: str) -> bool:
        """/abort_request: abort `rid`, or the copies of the request sent with n > 1 under that
        id ("<rid>-0", ...), also while they wait for their prompt's prefix to be cached;
        whether any was in flight."""
        def known(candidate: str) -> bool:
            return candidate in self.rid_to_state or candidate in self.waiting

        targets = [rid] if known(rid) else \
            [f"{rid}-{j}" for j in range(MAX_N) if known(f"{rid}-{j}")]
        for target in targets or [rid]:
            if target not in self.waiting:
                self.send_abort(target)
            elif (warmup := self.waiting.abort(target)) is not None:
                self.send_abort(warmup)
        return bool(targets)

    def abort(self, rid: str) -> None:
        """The consumer of `rid` is gone: abort it and forget it (counted as an abort)."""
        self.send_abort(rid)
        self.router.finished(rid)
        state = self.rid_to_state.pop(rid, None)
        if state is not None and not state.finished and not state.req.internal \
                and state.counted:
            self.metrics.observe_finish("abort", len(state.req.input_ids), len(state.output_ids),
                                        0, time.perf_counter() - state.created_time)

    def send_abort(self, rid: str) -> None:
        """Abort `rid` in the scheduler; its consumer still gets the final (abort) output."""
        replica = self.router.replica_of(rid)
        if self.send_socks and replica is not None:
            self.send_socks[replica].send_pyobj(AbortReq(rid=rid))

    # ---- control requests ----
    async def flush_cache(self) -> FlushCacheReply:
        replies = await self._request_replies(FlushCacheReq(), FlushCacheReply)
        failed = [r for r in replies if not r.success]
        return failed[0] if failed else replies[0]

    def note_states(self, states: list[InternalState]) -> InternalState:
        """Replicas' latest states (sent unasked, or answers to /get_server_info): the
        gauges of /metrics are their merge, which is returned."""
        for state in states:
            self.latest_states[state.dp_rank] = state
        merged = InternalState.merge([self.latest_states[r] for r in sorted(self.latest_states)])
        self.metrics.update_state(merged)
        return merged

    async def get_replica_states(self) -> list[InternalState]:
        """Each data-parallel replica's scheduler state, in replica order."""
        return await self._request_replies(GetInternalStateReq(), InternalState)

    async def _request_replies(self, message: Any, reply_type: type) -> list[Any]:
        """Ask every replica; their answers in replica order (each scheduler answers its
        requests in order, and replies of one type are matched by the replica that sent
        them)."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = []
        for replica, sock in enumerate(self.send_socks):
            future: asyncio.Future[Any] = loop.create_future()
            self.pending_replies[reply_type].append((replica, future))
            futures.append(future)
            sock.send_pyobj(message)
        try:
            return list(await asyncio.wait_for(asyncio.gather(*futures), REPLY_TIMEOUT_S))
        except asyncio.TimeoutError:
            raise APIError(f"the scheduler did not answer {type(message).__name__} in time",
                           status_code=503) from None

    # ---- internals ----
    def fail_all(self, message: str, status_code: int = 503) -> int:
        """Refuse new requests from now on and end every open one with this error (its
        stream gets an error event and [DONE]), and every control request waiting for a
        scheduler's answer (they waited for their timeout); returns how many requests were
        open. Event loop only; other threads call `fail_all_threadsafe`."""
        self.refusing = message
        open_states = [s for s in self.rid_to_state.values()
                       if not s.finished and s.error is None]
        for state in open_states:
            state.error = ReqError(state.req.rid, message, http_status=status_code)
            state.event.set()
        for waiters in self.pending_replies.values():
            for _, future in waiters:
                if not future.done():
                    future.set_exception(APIError(message, status_code=status_code))
            waiters.clear()
        return len(open_states)

    def fail_all_threadsafe(self, message: str) -> None:
        """`fail_all` from another thread, when the server failed: how many it ended adds to
        `ended_by_failure` (the shutdown summary's count)."""
        def fail() -> None:
            self.ended_by_failure += self.fail_all(message)

        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fail)

    def _send(self, req: GenerateRequest) -> ReqState:
        if self.refusing is not None:
            raise APIError(self.refusing, status_code=503)
        if req.rid in self.rid_to_state:
            raise APIError(f"request id {req.rid!r} is already in use", param="rid")
        state = ReqState(req=req)
        self.rid_to_state[req.rid] = state
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %r", req.rid, len(req.input_ids),
                        req.input_text if req.input_text is not None else req.input_ids)
        replica = self.router.route(req.rid, req.input_ids)
        self.send_socks[replica].send_pyobj(TokenizedGenerateReq(
            rid=req.rid, input_text=req.input_text, input_ids=req.input_ids,
            sampling_params=req.sampling_params, return_logprob=req.return_logprob,
            logprob_start_len=req.logprob_start_len, top_logprobs_num=req.top_logprobs_num,
            stream=req.stream, lora_name=req.lora_name, priority=req.priority,
            mm_inputs=req.mm_inputs))
        return state

    async def _wait(self, state: ReqState) -> None:
        """Until the request has news (an update that came while its consumer was busy is taken
        at once) or its client is gone. No timer per wait: at 1,000 streams the old 1 s
        wait_for + is_disconnected poll was ~20% of this process (H200 profile)."""
        if not state.event.is_set():
            await state.event.wait()
        state.event.clear()
        if state.disconnected:
            logger.info("client of request %s disconnected; aborting", state.req.rid)
            raise ClientDisconnected(state.req.rid)

    async def _recv_loop(self) -> None:
        while True:
            message = await self.recv_sock.recv_pyobj()
            try:
                self._handle(message)
            except Exception:  # noqa: BLE001 - one bad message must not stop the server
                logger.exception("failed to handle %s", type(message).__name__)

    def _handle(self, message: Any) -> None:
        if isinstance(message, BatchStrOut):
            self._handle_outputs(message)
        elif isinstance(message, SchedulerStateUpdate):
            self.note_states([message.state])
        elif isinstance(message, ReqError):
            state = self.rid_to_state.get(message.rid)
            if state is not None:
                state.error = message
                state.event.set()
        elif type(message) in self.pending_replies:
            waiters = self.pending_replies[type(message)]
            replica = getattr(message, "dp_rank", 0)
            # a replica answers in the order it was asked: this reply is its oldest waiter's,
            # even one that timed out (it is dropped then, not handed to the next waiter)
            for waiter in list(waiters):
                if waiter[0] == replica:
                    waiters.remove(waiter)
                    if not waiter[1].done():
                        waiter[1].set_result(message)
                    break
        else:
            logger.error("tokenizer manager got an unknown message %r", type(message).__name__)

    def _handle_outputs(self, batch: BatchStrOut) -> None:
        now = time.perf_counter()
        for i, rid in enumerate(batch.rids):
            state = self.rid_to_state.get(rid)
            if state is None:  # aborted by its consumer; nothing waits for it
                continue
            new_ids = batch.new_output_ids[i]
            text_fn = self._token_text_fn(state)
            first_token_wall = batch.meta_infos[i].pop(FIRST_TOKEN_TIME_KEY, None)
            state.add_piece(batch.text_deltas[i], new_ids, batch.meta_infos[i],
                            batch.finished_reasons[i], text_fn)
            if new_ids and state.req.stream and not state.req.internal:
                self.metrics.observe_tokens(now, state.created_time, state.first_token_time,
                                            state.last_token_time, len(new_ids))
                state.first_token_time = state.first_token_time or now
                state.last_token_time = now
            elif state.finished and first_token_wall is not None and \
                    not state.req.stream and not state.req.internal:
                # a non-streamed request's tokens all arrive at its end: its first-token
                # time is the scheduler's (no inter-token times: its tokens were not spaced)
                self.metrics.observe_first_token(max(0.0, first_token_wall - state.created_wall))
            if state.finished:
                self.router.finished(rid)
            if state.finished and not state.req.internal:
                meta = state.meta_info
                self.metrics.observe_finish(
                    str((meta.get("finish_reason") or {}).get("type", "unknown")),
                    len(state.req.input_ids), len(state.output_ids),
                    int(meta.get("cached_tokens", 0) or 0), now - state.created_time,
                    state.req.lora_name, len(state.req.mm_inputs or ()))
            state.event.set()

    def _token_text_fn(self, state: ReqState) -> Any:
        if state.req.return_text_in_logprobs:
            return lambda ids: token_texts(self.tokenizer, ids)
        return lambda ids: [None] * len(ids)

    def _log_finish(self, state: ReqState) -> None:
        if self.log_requests:
            logger.info("finished %s: %r, %s", state.req.rid, state.text,
                        state.meta_info.get("finish_reason"))


async def _watch_disconnect(http_request: Request, state: ReqState) -> None:
    """Wake the request's consumer when its client goes (ASGI http.disconnect). The handlers
    have read the body by now, so the next message the server hands this request is that one;
    it costs nothing while it waits (one task per request, not a poll per wait)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
    state.disconnected = True
    state.event.set()
