"""The scheduler: plain Python on the CPU. It owns the queues, budgets, prefix matching and slot
allocation; it hands batches to a ModelRunner and gets token ids back.

One turn (run_turn): admit a prefill batch if the budgets allow (continuing the request being
chunked first) and run it; otherwise run up to --num-continuous-decode-steps decode steps,
retracting requests when memory runs short and returning early when streamed output waits.

Under the overlap schedule (the default) each pass is launched before the host reads the
sampled ids of the pass before it, so the GPU always has the next pass queued while Python
appends tokens, checks stops, sends output and admits the next batch. Between turns one pass is
in flight (`inflight`, a decode step, or `inflight_prefill`): every launch settles the pass
launched before it, except that the one decode step between two chunks of a prompt leaves the
prefill in flight too. A prefill's requests join the decode batch once their first token is
read back, one step after the pass that follows them.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from radixserve.config import ServerArgs
from radixserve.core.finish_reason import FinishReason
from radixserve.core.multimodal import check_images
from radixserve.core.long_rope import long_rope_due, place_on_rope_table
from radixserve.core.io_struct import (BatchTokenIDOut, FlushCacheReply, ReqError,
                                       TokenizedGenerateReq)
from radixserve.core.req import Detokenizer, Req
from radixserve.core.request_validation import RequestLimits, check_lora_name, check_prompt
from radixserve.core.sampling_params import InvalidRequestError
from radixserve.mem.base_cache import BasePrefixCache
from radixserve.scheduler.admission import PrefillAdder
from radixserve.scheduler.batch import (BatchBuilder, images_in_pass, merge_mixed,
                                        wants_prompt_logprobs)
from radixserve.scheduler.cohort_gate import CohortGate
from radixserve.scheduler.grammar.manager import GrammarManager
from radixserve.scheduler.in_batch_prefix import InBatchPrefixIndex
from radixserve.scheduler.accounting import AccountingMixin
from radixserve.scheduler.kv_pressure import KVPressureMixin
from radixserve.scheduler.lora_updates import LoRAUpdatesMixin
from radixserve.scheduler.overlap import DecodeLauncher, InflightDecode, InflightPrefill
from radixserve.scheduler.overlap_loop import OverlapLoopMixin
from radixserve.scheduler.output import OutputSlice, build_token_output, needs_send
from radixserve.scheduler.policy import SchedulePolicy, match_prefix
from radixserve.scheduler.priority import PriorityMixin, PriorityOrder
from radixserve.scheduler.retraction import NewTokenRatio
from radixserve.scheduler.runner_protocol import ModelRunnerLike
from radixserve.scheduler.spec_decode import SpecDecodeMixin, make_proposer
from radixserve.scheduler.stats import SchedulerStats


class Scheduler(OverlapLoopMixin, KVPressureMixin, SpecDecodeMixin, LoRAUpdatesMixin,
                AccountingMixin, PriorityMixin):
    """The loop of turns, admission and results; the overlapped decode loop, the KV pressure
    handling, speculative steps, LoRA updates, the KV accounting and priority preemption are
    its mixins (overlap_loop.py, kv_pressure.py, spec_decode.py, lora_updates.py,
    accounting.py, priority.py)."""

    def __init__(self, server_args: ServerArgs, model_runner: ModelRunnerLike,
                 tokenizer: Detokenizer | None, eos_token_ids: set[int], context_len: int) -> None:
        self.args = server_args.resolve()
        self.runner = model_runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.max_total_num_tokens = model_runner.max_total_num_tokens
        self.max_running_requests = min(self.args.max_running_requests or model_runner.max_num_reqs,
                                         model_runner.max_num_reqs)
        self.tree_cache = self._make_cache()
        # what the model's images look like in a prompt (core/multimodal.py), None: no images
        self.vision = getattr(model_runner, "vision_spec", None)
        self.long_rope = getattr(model_runner, "long_rope", None)  # core/long_rope.py
        self.limits = RequestLimits.from_model_info(self.model_info)  # LoRA: lora_updates.py
        self.priority_order = PriorityOrder(self.args.schedule_low_priority_values_first,
                                            self.args.priority_scheduling_preemption_threshold) \
            if self.args.enable_priority_scheduling else None
        self.policy = SchedulePolicy(self.args.schedule_policy, self.tree_cache,
                                     self.args.random_seed, self.priority_order)
        self.builder = BatchBuilder(self.req_to_token_pool, self.token_to_kv_pool,
                                    self.tree_cache, model_runner.vocab_size, eos_token_ids,
                                    model_runner.device)
        self.ratio = NewTokenRatio(self.args.schedule_conservativeness)
        # --admission-plan cohorts: bursts of known-length requests admitted in whole cohorts
        self.cohort_gate = CohortGate() if self.args.admission_plan == "cohorts" else None
        self.stats = SchedulerStats()

        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.last_turn_was_chunk = False
        self.outbox: list[Req] = []
        self.last_memory_check: tuple[bool, int] | None = None
        # overlap: steps launched before the last one's ids are read; the last, unread one
        self.launcher = None if self.args.disable_overlap_schedule else \
            DecodeLauncher(model_runner, self.builder)
        self.inflight: InflightDecode | None = None
        # a prefill batch launched and not yet read back (its requests join `running` then)
        self.inflight_prefill: InflightPrefill | None = None
        self.speculator = make_proposer(self.args, model_runner)  # decode steps then verify
        # grammars compile in a worker thread (with TP rank 0 says when: ReplicatedScheduler)
        self.grammars = GrammarManager(tokenizer, model_runner.vocab_size, eos_token_ids,
                                       context_len, self.args.enable_jump_forward,
                                       replicated=self.args.tp_size > 1)

    def _make_cache(self) -> BasePrefixCache:
        if self.args.disable_radix_cache:
            from radixserve.mem.chunk_cache import ChunkCache
            return ChunkCache(self.req_to_token_pool, self.token_to_kv_pool)
        state_pool = getattr(self.runner, "state_pool", None)
        if state_pool is not None:  # a hybrid model: prefixes end where states are kept
            from radixserve.mem.hybrid_radix_cache import HybridRadixCache
            return HybridRadixCache(self.req_to_token_pool, self.token_to_kv_pool, state_pool)
        from radixserve.mem.radix_cache import RadixCache
        return RadixCache(self.req_to_token_pool, self.token_to_kv_pool)

    @classmethod
    def build(cls, server_args: ServerArgs, tp_rank: int = 0,
              source: Any = None) -> "Scheduler":
        """Load the model and tokenizer named by the args (as tensor-parallel rank `tp_rank`:
        every rank builds the same scheduler, tokenizer included, so their turns agree)."""
        from radixserve.executor.model_runner import ModelRunner
        from radixserve.loader.tokenizer import model_tokenizer
        server_args.resolve()
        runner = ModelRunner(server_args, source, tp_rank=tp_rank,
                             dist_init_method=server_args.dist_init_method)
        tokenizer = None  # the server's (--tokenizer-path's where given): grammars, stop text
        if not server_args.skip_tokenizer_init:
            tokenizer = model_tokenizer(server_args.tokenizer_path, runner.source.model_path,
                                        required=False, model=runner.source.tokenizer_source)
        eos = set(runner.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        return cls(server_args, runner, tokenizer, eos, runner.model_config.context_length)

    @property
    def model_info(self) -> dict[str, Any]:
        return {"context_len": self.context_len, "max_total_num_tokens": self.max_total_num_tokens,
                "vocab_size": self.runner.vocab_size, "eos_token_ids": sorted(self.eos_token_ids),
                "max_running_requests": self.max_running_requests,
                "lora_adapters": list(self.args.lora_adapters()),
                "lora_paths": self.args.lora_adapters(), "max_prefill_tokens":
                None if self.args.chunked_prefill_enabled else self.args.max_prefill_tokens,
                "priority_scheduling": self.args.enable_priority_scheduling,
                "vision": None if self.vision is None else
                dict(dataclasses.asdict(self.vision), model_path=self.runner.source.model_path,
                     dtype=str(self.runner.dtype).removeprefix("torch."))}

    # ---- requests in ----
    def add_request(self, msg: TokenizedGenerateReq) -> ReqError | None:
        error = self._validate(msg)
        if error is not None:
            return ReqError(msg.rid, error)
        limit = self.args.max_queued_requests
        if limit is not None and len(self.waiting_queue) >= limit:
            return ReqError(msg.rid, f"too many queued requests (limit {limit}); retry later",
                            http_status=429)
        params = msg.sampling_params
        most = self.limits.max_sequence_tokens - len(msg.input_ids)
        if params.max_new_tokens > most:  # the front ends refuse it: a caller that bypassed
            # them gets what the KV cache holds (more could never be admitted, and would
            # hold up the queue behind it)
            params = dataclasses.replace(params, max_new_tokens=most,
                                         min_new_tokens=min(params.min_new_tokens, most))
        req = Req(msg.rid, msg.input_ids, params, msg.input_text, msg.return_logprob,
                  msg.logprob_start_len, msg.top_logprobs_num, msg.stream, msg.lora_name,
                  self.lora_cache_id(msg.lora_name), msg.mm_inputs)
        req.priority = msg.priority or 0
        place_on_rope_table(self.long_rope, req)
        if self.vision is not None and self.vision.bidirectional:
            req.whole_spans = [(image.offset, image.end) for image in req.mm_inputs]
        error = self.grammars.on_add(req)
        if error is not None:
            return ReqError(msg.rid, error)
        self.waiting_queue.append(req)
        return None

    def _validate(self, msg: TokenizedGenerateReq) -> str | None:
        if self.args.is_embedding and (msg.sampling_params.max_new_tokens or msg.return_logprob):
            return "an embedding model generates no tokens: ask /v1/embeddings or /encode"
        try:
            check_prompt(msg.input_ids, self.limits)
            check_lora_name(msg.lora_name, self.limits)
            check_images(msg.input_ids, msg.mm_inputs or [], self.vision)
        except InvalidRequestError as exc:
            return str(exc)
        return None

    def abort_request(self, rid: str) -> None:
        self._settle()  # a request in the step in flight gets its token first
        for i, req in enumerate(self.waiting_queue):
            if req.rid == rid:
                del self.waiting_queue[i]
                self._finish(req, FinishReason.abort(), release=False)
                return
        if self.chunked_req is not None and self.chunked_req.rid == rid:
            req, self.chunked_req = self.chunked_req, None
            self._finish(req, FinishReason.abort())
            return
        for i, req in enumerate(self.running):
            if req.rid == rid:
                del self.running[i]
                self._finish(req, FinishReason.abort())
                return

    def _finish(self, req: Req, reason: FinishReason | None = None, release: bool = True) -> None:
        if reason is not None:
            req.finished_reason = reason
        if release:
            self.tree_cache.cache_finished_req(req, token_ids=req.all_ids()[:req.kv_len])
            req.kv_len = 0
        self.outbox.append(req)

    def flush_cache(self) -> FlushCacheReply:
        self._settle()
        if self.running or self.waiting_queue or self.chunked_req is not None:
            return FlushCacheReply(False, "cannot flush the cache while requests are in flight")
        self.tree_cache.reset()  # the tree forgets its slots: hand them all back
        self.token_to_kv_pool.clear()
        self.req_to_token_pool.clear()
        self.stats = self.stats.after_flush()
        return FlushCacheReply(True, "cache flushed")

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.running or self.chunked_req or self.outbox
                    or self.inflight or self.inflight_prefill)

    def admitted_reqs(self) -> list[Req]:
        """The running requests, and those of the prefill in flight that will join them."""
        pending = self.inflight_prefill
        if pending is None:
            return self.running
        return self.running + [r for r, chunk_only in zip(pending.reqs, pending.chunk_only)
                               if not chunk_only]

    def _in_flight(self) -> bool:
        return self.inflight is not None or self.inflight_prefill is not None

    def _idle(self) -> bool:
        """Nothing queued, running, being chunked or in flight (the memory check's moment)."""
        return not (self.waiting_queue or self.running or self.chunked_req
                    or self._in_flight())

    # ---- one turn ----
    def run_turn(self) -> list[BatchTokenIDOut]:
        # while a prompt is being chunked, decode gets every other turn (unless the two share
        # a pass): streams then wait at most one chunk, not the whole prompt
        decode_turn = (self.chunked_req is not None and bool(self.running)
                       and self.last_turn_was_chunk and not self.args.enable_mixed_chunk)
        prefill = None if decode_turn else self._get_new_prefill_batch()
        self.last_turn_was_chunk = prefill is not None and self.chunked_req is not None
        if decode_turn:
            self._run_decode(1, keep_prefill=True)
        elif prefill and self._can_mix(prefill):
            self._settle()  # the mixed pass reads every request's tokens so far
            self._run_mixed(prefill)
        elif prefill:
            self._run_prefill(prefill)
        elif self.running or self._in_flight():
            self._run_decode(max(1, self.args.num_continuous_decode_steps))
        elif self.waiting_queue:  # nothing ran: the queue waits for grammars to compile
            self.grammars.wait_any(self.waiting_queue, timeout_s=0.01)
        if self._idle():
            self._on_idle()
        return self._drain_outbox()

    def _run_decode(self, steps: int, keep_prefill: bool = False) -> None:
        """keep_prefill: a decode turn between two chunks; see _run_decode_steps_overlapped."""
        # a grammar's mask needs the previous token on the host: constrained = synchronous
        if self.launcher is not None and self.speculator is None and \
                all(r.grammar is None for r in self.running):
            self._run_decode_steps_overlapped(self.launcher, steps, keep_prefill)
            return
        self._settle()
        for _ in range(steps):
            self._run_decode_step()
            if not self.running or self._streamed_output_waiting():
                break

    def _streamed_output_waiting(self) -> bool:
        return any(r.stream and needs_send(r, self.args.stream_interval) for r in self.running)

    def _drain_outbox(self) -> list[BatchTokenIDOut]:
        ready = list(self.outbox)
        self.outbox.clear()
        seen = {id(r) for r in ready}
        ready += [r for r in self.running if id(r) not in seen
                  and needs_send(r, self.args.stream_interval)]
        out = build_token_output(ready)
        return [out] if out is not None else []

    # ---- prefill ----
    def _get_new_prefill_batch(self) -> list[Req] | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        self._end_failed_grammars()
        running = self.admitted_reqs()
        if len(running) >= self.max_running_requests:
            self._preempt_for_priority(self.waiting_queue)
            return None
        chunked = self.chunked_req
        if chunked is not None:
            chunked.init_next_round_input()
            chunked.extend_input_len = len(chunked.fill_ids) - len(chunked.prefix_indices)
        ordered = self.policy.order(self.waiting_queue) if self.waiting_queue else []
        matched = self.policy.matches_all(len(self.waiting_queue))
        adder = PrefillAdder.create(
            self.tree_cache, self.token_to_kv_pool.available_size(), running, chunked,
            self.ratio.value, self.args.max_prefill_tokens,
            self.args.chunked_prefill_size if self.args.chunked_prefill_enabled else None,
            self.max_running_requests - len(running))
        in_batch = InBatchPrefixIndex(self.tree_cache, chunked) \
            if self.policy.policy in ("lpm", "dfs-weight") and \
            self.tree_cache.defers_shared_prompts else None
        allowance = None if self.cohort_gate is None else self.cohort_gate.allowance(
            ordered, running,
            self.token_to_kv_pool.available_size() + self.tree_cache.evictable_size(),
            self.max_total_num_tokens)
        if chunked is not None:
            adder.add_chunked_req(chunked)
        scanned = 0  # requests of `ordered` the loop looked at
        for req in ordered:
            if allowance is not None and adder.admitted_from_queue >= allowance:
                break
            scanned += 1
            if not self.grammars.ready(req):  # compiling (or failed: ended next turn)
                continue
            if not matched:
                match_prefix(req, self.tree_cache)
            if in_batch is not None and in_batch.should_defer(req):
                continue  # its prefix will be cached after this batch
            if not adder.add_one_req(req):
                break
            if in_batch is not None:
                in_batch.add(req)
        if not adder.can_run:
            self._preempt_for_priority(ordered)
            return None
        if self.cohort_gate is not None:
            self.cohort_gate.admitted(adder.admitted_from_queue)
        admitted = {id(r) for r in adder.can_run}
        queue = self.waiting_queue
        if self.policy.keeps_queue_order(len(queue)):
            # admission walked the queue itself: only its first `scanned` can have gone (a
            # turn over a queue of thousands then costs what it admits, not the queue)
            self.waiting_queue = [r for r in queue[:scanned] if id(r) not in admitted]
            self.waiting_queue += queue[scanned:]
        else:
            self.waiting_queue = [r for r in queue if id(r) not in admitted]
        for req in adder.can_run:
            if req is not chunked and not req.output_ids and req.retraction_count == 0:
                req.cached_tokens = len(req.prefix_indices)
            if req.retraction_count:  # the positions this pass computes a second time
                start = len(req.prefix_indices)
                self.stats.num_recomputed_tokens += max(0, min(
                    start + req.extend_input_len, req.computed_before_retraction) - start)
        self.chunked_req = adder.new_chunked_req
        images = images_in_pass(adder.can_run, [r.extend_input_len for r in adder.can_run])
        self.stats.log_prefill(len(adder.can_run), adder.new_input_tokens,
                               adder.new_cached_tokens, self.token_usage(), len(running),
                               len(self.waiting_queue), self.chunked_req is not None,
                               sum(map(len, images)))
        return adder.can_run

    def _end_failed_grammars(self) -> None:
        """Requests whose grammar did not compile end with its error (no memory held)."""
        failed, self.grammars.failed = self.grammars.failed, []
        for req, message in failed:
            if req in self.waiting_queue:
                self.waiting_queue.remove(req)
                self._finish(req, FinishReason.abort(message), release=False)

    def _run_prefill(self, reqs: list[Req]) -> None:
        """Under the overlap schedule: launch the batch, share its prompts' KV in the prefix
        cache at once (the device writes it before any later pass reads it: they run in
        launch order), then settle the pass launched before it while this one runs. Its ids
        are read when the next pass is launched (or anything settles). Prompt logprobs are
        assembled on the host: such batches run synchronously."""
        self._ensure_prefill_memory(reqs)
        if self.launcher is None or any(wants_prompt_logprobs(r) for r in reqs):
            self._settle()
            batch = self.builder.prepare_extend(reqs)
            self._process_prefill_results(reqs, self.runner.forward(batch))
            return
        batch = self.builder.prepare_extend(reqs)
        handle = self.runner.forward_extend_async(batch)
        chunk_only = [r.is_being_chunked for r in reqs]
        for req in reqs:
            self.tree_cache.cache_unfinished_req(req)
        self._settle()
        self.inflight_prefill = InflightPrefill(handle, reqs, chunk_only)

    def _can_mix(self, prefill: list[Req]) -> bool:
        """--enable-mixed-chunk: run the prefill (chunk) and the decode batch in one pass."""
        return (self.args.enable_mixed_chunk and bool(self.running)
                and not any(r.return_logprob for r in prefill + self.running))

    def _run_mixed(self, prefill: list[Req]) -> None:
        self._ensure_decode_memory(extra_tokens=sum(r.extend_input_len for r in prefill))
        if not self.running:
            self._run_prefill(prefill)
            return
        # the merged pass gets one sampling info for all its requests
        extend = self.builder.prepare_extend(prefill, with_sampling=False)
        decode = self.builder.prepare_decode(self.running, with_sampling=False, for_mixed=True)
        sampling = self.builder.sampling_info(prefill + self.running)
        out = self.runner.forward(merge_mixed(extend, decode, sampling))
        n = len(prefill)
        self._process_decode_results(OutputSlice(out, n))
        self._process_prefill_results(prefill, out)

    def _process_prefill_results(self, reqs: list[Req], out: Any,
                                 launched: InflightPrefill | None = None) -> None:
        """`launched`: the pass was launched ahead (its prompts are in the cache already, and
        its chunk flags are the ones it ran with)."""
        for i, req in enumerate(reqs):
            if req.return_logprob and out.input_token_logprobs is not None:
                req.input_token_logprobs += out.input_token_logprobs[i]
                if req.top_logprobs_num and out.input_top_logprobs is not None:
                    req.input_top_logprobs += out.input_top_logprobs[i]
            chunk_only = req.is_being_chunked if launched is None else launched.chunk_only[i]
            if chunk_only:
                # this chunk's KV becomes the prefix the next chunk extends
                if launched is None:
                    self.tree_cache.cache_unfinished_req(req)
                continue
            if req.sampling_params.max_new_tokens == 0:
                req.embedding = out.embeddings[i] if out.embeddings is not None else None
                self._finish(req, FinishReason.max_length(0))
                continue
            if req.first_token_time is None:  # every request's first token comes from here
                req.first_token_time = time.time()
            if self._take_token(req, i, out):
                if launched is None:  # share the prompt's KV with later requests right away
                    self.tree_cache.cache_unfinished_req(req)
                self.running.append(req)

    def _take_token(self, req: Req, i: int, out: Any) -> bool:
        """Append row i's sampled token, then end the request or requeue it (jump-forward,
        LongRoPE's long table due) as the token says; True when it decodes on."""
        jumped = self._append_token(req, i, out)
        if req.finished:
            self._finish(req)
        elif jumped or long_rope_due(self.long_rope, req):
            self._requeue_for_extend(req)
        else:
            return True
        return False

    def _append_token(self, req: Req, i: int, out: Any) -> int:
        """Append a sampled token; returns how many jump-forward added (`_requeue_for_extend`)."""
        req.output_ids.append(out.next_token_ids[i])
        if req.return_logprob and out.next_token_logprobs is not None:
            req.output_token_logprobs.append((out.next_token_logprobs[i], out.next_token_ids[i]))
            if req.top_logprobs_num and out.next_top_logprobs is not None:
                req.output_top_logprobs.append(out.next_top_logprobs[i])
        req.check_finished(self.eos_token_ids, self.context_len, self.tokenizer)
        if req.grammar is None:
            return 0
        jumped = self.grammars.after_token(req)
        if jumped:
            req.check_finished(self.eos_token_ids, self.context_len, self.tokenizer)
        elif not req.finished and req.grammar.terminated:
            # the grammar took its stop token: it ends the request even where min_new_tokens
            # or ignore_eos would go on (every later token would break the grammar)
            req.finished_reason = FinishReason.stop_token(req.output_ids[-1])
        return jumped

    def _requeue_for_extend(self, req: Req) -> None:
        """Jump-forward appended tokens without KV, or LongRoPE's long table is due: back to the
        queue's front with its KV cached (a retraction that does not count as one); its next
        prefill extends (on the table its length asks for) and samples on."""
        self.tree_cache.cache_finished_req(req, token_ids=req.all_ids()[:req.kv_len])
        req.kv_len = 0
        place_on_rope_table(self.long_rope, req)
        self.waiting_queue.insert(0, req)

    # ---- decode ----
    def _run_decode_step(self) -> None:
        if self.speculator is not None:
            return self._run_spec_decode_step()
        self._ensure_decode_memory()
        if not self.running:
            return
        batch = self.builder.prepare_decode(self.running)
        self._process_decode_results(self.runner.forward(batch))

    def _process_decode_results(self, out: Any) -> None:
        still_running: list[Req] = []
        for i, req in enumerate(self.running):
            if self._take_token(req, i, out):
                still_running.append(req)
        self._after_decode_step(len(self.running), still_running)

    def _after_decode_step(self, batch_size: int, still_running: list[Req]) -> None:
        self.stats.on_decode_step(batch_size, self.tokens_in_use(), self.token_usage(),
                                  len(self.waiting_queue))
        self.running = still_running
        self.ratio.decay()
