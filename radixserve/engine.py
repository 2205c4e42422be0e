"""The offline Engine: the scheduler driven in this process, no HTTP.

    engine = radixserve.Engine()            # the bundled SmolLM2-135M-Instruct
    engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
    engine.chat([{"role": "user", "content": "Hi!"}], {"max_new_tokens": 16})
    for chunk in engine.generate_stream("Tell me a story", {"max_new_tokens": 64}):
        print(chunk["text"], end="")

Every request goes through the same Scheduler (admission, radix cache, retraction, chunked
prefill) that the server runs, so an Engine test is a test of the server's scheduling.

Whichever call drives the scheduler (a `generate`, a stream being iterated, another thread),
each turn's outputs go to the requests they belong to (`_states`), so streams left suspended,
interleaved or read from other threads each get all of their own tokens. One lock serialises
the scheduler's turns; a call returns once its own requests finish, and runs the scheduler
dry only when no other request is waiting for its caller.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import threading
import uuid
from dataclasses import replace
from typing import Any, Iterator

from radixserve.config import ServerArgs
from radixserve.core.io_struct import TokenizedGenerateReq
from radixserve.core.req import EMBEDDING_KEY, FIRST_TOKEN_TIME_KEY
from radixserve.core.request_validation import validate_request
from radixserve.core.sampling_params import InvalidRequestError, SamplingParams
from radixserve.distributed.parallel_state import get_tp_group
from radixserve.scheduler.grammar.validation import check_grammar
from radixserve.scheduler.replicated import ReplicatedScheduler
from radixserve.scheduler.scheduler import Scheduler
from radixserve.server.tp_follower_process import (FollowerWatch, cpu_threads_per_rank,
                                                   start_tp_followers)
from radixserve.server.image_inputs import (ImageOptions, conversation_images,
                                           image_reader, per_prompt_images)
from radixserve.server.openai_protocol import ImageRendering
from radixserve.server.incremental_detokenizer import IncrementalDetokenizer, stop_match

logger = logging.getLogger(__name__)

Params = dict[str, Any] | SamplingParams | None


def _to_params(params: Params, defaults: dict[str, Any]) -> SamplingParams:
    """A copy: validation normalises it, and the caller's object stays as given. A dict's
    unset fields take the model's defaults (its generation config), as the server's do."""
    if isinstance(params, SamplingParams):
        return replace(params)
    return SamplingParams.from_dict({**defaults, **(params or {})})


class _Pending:
    """One request's accumulated output on the engine side."""

    def __init__(self, rid: str, detok: IncrementalDetokenizer | None, stream: bool) -> None:
        self.rid = rid
        self.detok = detok
        self.stream = stream
        self.text = ""
        self.output_ids: list[int] = []
        self.meta: dict[str, Any] = {"id": rid}
        self.finished = False
        # a stream's chunks not yet read (none kept otherwise): (text delta, output ids so
        # far, finished)
        self.chunks: list[tuple[str, int, bool]] = []

    def absorb(self, new_ids: list[int], finish: dict[str, Any] | None,
               meta: dict[str, Any]) -> str:
        self.output_ids += new_ids
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if key in meta:
                self.meta.setdefault(key, []).extend(meta.pop(key))
        meta.pop(FIRST_TOKEN_TIME_KEY, None)  # the server's metrics' field, as there
        self.meta.update(meta)
        delta = ""
        if self.detok is not None:
            if finish is None:
                delta = self.detok.append(new_ids)
            else:
                delta = self.detok.finish(new_ids, stop_match(finish))
        self.text += delta
        self.finished = finish is not None
        if self.stream:
            self.chunks.append((delta, len(self.output_ids), self.finished))
        return delta

    def result(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.meta}


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        if model_path is not None:
            kwargs["model_path"] = model_path
        self.server_args = ServerArgs(**kwargs).resolve()
        if self.server_args.dp_size > 1 or self.server_args.nnodes > 1:
            raise ValueError("the offline Engine runs one replica on one node: --dp-size and "
                             "--nnodes are the server's (radixserve serve)")
        # --tp-size N: ranks 1..N-1 in processes of their own, following this one (rank 0).
        # A split the layers cannot make is refused here, before any rank starts; a rank
        # that dies later takes this process down with its traceback logged (as the server)
        source = None
        if self.server_args.tp_size > 1:  # loaded once: rank 0's runner builds from it
            from radixserve.executor.model_runner import check_tensor_parallel
            from radixserve.loader import load_model_source
            source = load_model_source(self.server_args.model_path, self.server_args.load_format,
                                       self.server_args.model_overrides())
            check_tensor_parallel(source.model_config, self.server_args.tp_size)
        cpu_threads_per_rank(self.server_args)
        self._followers = start_tp_followers(self.server_args)
        self._follower_watch = FollowerWatch(self._followers)
        try:
            scheduler = Scheduler.build(self.server_args, source=source)
        except BaseException:
            self._follower_watch.stop()
            for process, _ in self._followers:
                process.terminate()
            raise
        self._runner = scheduler.runner
        self.scheduler: Any = scheduler if self.server_args.tp_size == 1 else \
            ReplicatedScheduler(scheduler, get_tp_group())
        self.tokenizer = self.scheduler.tokenizer
        # a model that reads images: its image processor, placeholders, sources
        self._images = image_reader(scheduler.model_info.get("vision"),
                                    ImageOptions.of(self.server_args, trust_local_paths=True),
                                    self.tokenizer)
        self.generation_defaults = dict(self._runner.source.generation_defaults)
        self._ids = itertools.count()
        self._closed = False
        self._lock = threading.RLock()  # one scheduler turn at a time, from any thread
        self._states: dict[str, _Pending] = {}  # every request whose caller still waits
        if self._followers:
            # an Engine never shut down: at interpreter exit the handlers registered while it
            # was built (the process group's) and then multiprocessing end the followers first;
            # that is no death to report (this one runs before them)
            atexit.register(self._follower_watch.stop)

    # ---- inputs ----
    def _make_reqs(self, prompt: str | list[str] | None, input_ids: Any, sampling_params: Any,
                   return_logprob: bool, logprob_start_len: int, top_logprobs_num: int,
                   stream: bool, lora_path: str | list[str | None] | None = None,
                   priority: int | list[int | None] | None = None,
                   image_data: Any = None) -> list[TokenizedGenerateReq]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("give exactly one of prompt and input_ids")
        single = _is_single(prompt, input_ids)
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if prompts is not None and (not isinstance(prompts, (list, tuple)) or not all(
                isinstance(p, str) for p in prompts)):
            raise InvalidRequestError("prompt must be a string or a list of strings")
        ids_list = None if input_ids is None else [
            _token_ids(ids) for ids in ([input_ids] if single else _id_lists(input_ids))]
        n_items = len(prompts) if prompts is not None else len(ids_list)
        if n_items == 0:
            raise InvalidRequestError("empty batch")
        params_list = sampling_params if isinstance(sampling_params, list) \
            else [sampling_params] * n_items
        if not all(p is None or isinstance(p, (dict, SamplingParams)) for p in params_list):
            raise InvalidRequestError("sampling_params must be a dict, a SamplingParams or a "
                                      "list of them (one per prompt)")
        if len(params_list) != n_items:
            raise InvalidRequestError("sampling_params list must match the number of prompts")
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * n_items
        priorities = priority if isinstance(priority, list) else [priority] * n_items
        if len(loras) != n_items or len(priorities) != n_items:
            raise InvalidRequestError("lora_path and priority lists must match the number of "
                                      "prompts")
        images = per_prompt_images(image_data, None if single else n_items)
        if self._images is None and any(images):
            raise InvalidRequestError("this model reads no images", param="image_data")
        limits = self.scheduler.limits  # its LoRA adapters of the moment
        id_lists: list[list[int]] = []
        for i in range(n_items):
            text = prompts[i] if prompts is not None else None
            if text is None:
                id_lists.append(ids_list[i])
                continue
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer; pass input_ids")
            id_lists.append(self.tokenizer.encode(
                text if self._images is None else self._images.expand_text(text, len(images[i]))))
        # every prompt's images at once (processed in threads): ids expanded, ImageInputs
        prepared = None
        if self._images is not None:
            reader = self._images
            for sources in images:  # before any is read
                reader.check_count(len(sources))
            prepared = reader.prepare_many([
                (ids, [reader.read_source(source, k) for k, source in enumerate(sources)])
                for ids, sources in zip(id_lists, images)])
        reqs: list[TokenizedGenerateReq] = []
        for i in range(n_items):
            params = _to_params(params_list[i], self.generation_defaults)
            text = prompts[i] if prompts is not None else None
            ids, mm_inputs = prepared[i] if prepared is not None else (id_lists[i], None)
            # the server's rules (core/request_validation.py): the same request is refused or
            # accepted alike by both
            validate_request(ids, params, limits, logprob_start_len, top_logprobs_num,
                             loras[i], priorities[i])
            check_grammar(params, has_tokenizer=self.tokenizer is not None)
            for j in range(params.n):
                reqs.append(TokenizedGenerateReq(
                    rid=f"{uuid.uuid4().hex}-{next(self._ids)}", input_text=text, input_ids=ids,
                    sampling_params=params.for_sample(j),
                    return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                    stream=stream, lora_name=loras[i], priority=priorities[i],
                    mm_inputs=mm_inputs))
        return reqs

    def _submit(self, reqs: list[TokenizedGenerateReq]) -> dict[str, _Pending]:
        pending: dict[str, _Pending] = {}
        with self._lock:
            for req in reqs:
                error = self.scheduler.add_request(req)
                if error is not None:
                    self._end_call(pending)
                    raise InvalidRequestError(error.message)
                params = req.sampling_params
                detok = None if self.tokenizer is None else IncrementalDetokenizer(
                    self.tokenizer, params.skip_special_tokens,
                    params.spaces_between_special_tokens, params.stop_strs,
                    params.keep_special_tokens, params.include_stop_str_in_output)
                pending[req.rid] = self._states[req.rid] = _Pending(req.rid, detok,
                                                                    req.stream)
        return pending

    def _turn(self) -> None:
        """One scheduler turn; its outputs go to the requests they belong to (called with
        the lock held)."""
        for out in self.scheduler.run_turn():
            for i, rid in enumerate(out.rids):
                state = self._states.get(rid)
                if state is not None:
                    state.absorb(out.new_output_ids[i], out.finished_reasons[i],
                                 out.meta_infos[i])

    def _advance(self, pending: dict[str, _Pending]) -> None:
        """One turn unless another thread's turn already moved these requests on."""
        with self._lock:
            self._check_open()
            if all(state.finished or state.chunks for state in pending.values()):
                return
            if not self.scheduler.has_work():
                lost = [rid for rid, state in pending.items() if not state.finished]
                raise RuntimeError(f"requests {lost} are no longer scheduled")
            self._turn()

    def _end_call(self, pending: dict[str, _Pending]) -> None:
        """The caller stops waiting (done, failed or gone): abort what has not finished, so
        its memory is freed, then forget its requests (nothing to do once shut down)."""
        if self._closed:
            return
        with self._lock:
            for rid, state in pending.items():
                if not state.finished:
                    self.scheduler.abort_request(rid)
        self._release(pending)

    def _release(self, pending: dict[str, _Pending]) -> None:
        """The caller has what it waited for: forget its requests, and run the scheduler dry
        (a decode step launched past the last stop token is still in flight) unless other
        requests are waiting for their callers (they are not run to completion here)."""
        with self._lock:
            for rid in pending:
                self._states.pop(rid, None)
            if not self._states:
                self._drain()

    def _drain(self) -> None:
        while self.scheduler.has_work():
            self._turn()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the Engine is shut down")

    # ---- public API ----
    def generate(self, prompt: str | list[str] | None = None, sampling_params: Any = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, lora_path: str | list[str | None] | None = None,
                 priority: int | list[int | None] | None = None, image_data: Any = None
                 ) -> dict[str, Any] | list[dict[str, Any]]:
        """Run to completion. One prompt -> one dict (a list when n > 1); a list -> a list.
        lora_path: a --lora-paths adapter's name for every prompt, or one per prompt (None:
        the base model); priority (--enable-priority-scheduling) likewise. image_data (a
        model that reads images): a prompt's image (PIL image, path, URL, data URL, base64) or
        list of them, one such item per prompt for a list of prompts; the prompt holds a
        placeholder for each (LLaVA's <image>). Safe from several threads (their requests
        share the batch)."""
        self._check_open()
        reqs = self._make_reqs(prompt, input_ids, sampling_params, return_logprob,
                               logprob_start_len, top_logprobs_num, stream=False,
                               lora_path=lora_path, priority=priority, image_data=image_data)
        pending = self._submit(reqs)
        try:
            while not all(p.finished for p in pending.values()):
                self._advance(pending)
        finally:
            self._end_call(pending)
        results = [pending[r.rid].result() for r in reqs]
        return results[0] if _is_single(prompt, input_ids) and len(results) == 1 else results

    def encode(self, prompt: str | list[str] | None = None,
               input_ids: list[int] | list[list[int]] | None = None
               ) -> dict[str, Any] | list[dict[str, Any]]:
        """An embedding model's vectors (--is-embedding), as SGLang's Engine.encode: one input
        -> {"embedding": [floats], "meta_info"}; a list -> a list."""
        if not self.server_args.is_embedding:
            raise InvalidRequestError("encode needs an embedding model (--is-embedding)")
        outs = self.generate(prompt, {"max_new_tokens": 0}, input_ids)
        results = [{"embedding": out["meta_info"].pop(EMBEDDING_KEY), "meta_info": out["meta_info"]}
                   for out in (outs if isinstance(outs, list) else [outs])]
        return results if isinstance(outs, list) else results[0]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: Any = None, *, tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             **generate_kwargs: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """`generate` over conversations rendered by the model's chat template, as vLLM's
        `LLM.chat` and the server's chat route render them (the template writes the special
        tokens). One conversation (a list of messages) -> as one prompt; a list of them -> a
        list. The output is the raw text: no tool-call or reasoning parsing."""
        self._check_open()
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("chat needs a tokenizer with a chat template")
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        if not conversations or not all(isinstance(c, list) and c for c in conversations):
            raise InvalidRequestError("messages must be a list of message dicts, or a list of "
                                      "such lists")
        ids, images = [], []
        marker = None if self._images is None else self._images.spec.image_marker
        rendering = ImageRendering.for_template(str(self.tokenizer.chat_template), marker or "")
        for conversation in conversations:
            messages, sources = conversation_images(conversation, marker, rendering.as_parts)
            images.append(sources)
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **(chat_template_kwargs or {}))
            except Exception as exc:  # noqa: BLE001 - the template's verdict on the input
                raise InvalidRequestError(f"the chat template rejected the messages: {exc}") \
                    from exc
            if self._images is not None:
                text = self._images.expand_text(text, len(sources))
            ids.append(list(self.tokenizer.encode(text, add_special_tokens=False)))
        if any(images):
            generate_kwargs["image_data"] = images[0] if single else images
        return self.generate(input_ids=ids[0] if single else ids,
                             sampling_params=sampling_params, **generate_kwargs)

    def generate_stream(self, prompt: str | None = None, sampling_params: Any = None,
                        input_ids: list[int] | None = None,
                        lora_path: str | None = None,
                        priority: int | None = None) -> Iterator[dict[str, Any]]:
        """Yield {"text": delta, "output_ids": ids so far, "meta_info", "finished"}. The
        request runs while anything drives the scheduler (this iterator, `generate`, another
        stream), and its chunks wait here until read; closing the iterator early aborts it."""
        self._check_open()
        reqs = self._make_reqs(prompt, input_ids, sampling_params, False, -1, 0, stream=True,
                               lora_path=lora_path, priority=priority)
        if len(reqs) != 1:
            raise InvalidRequestError("generate_stream takes one prompt with n = 1")
        return self._stream(self._submit(reqs), reqs[0].rid)

    def _stream(self, pending: dict[str, _Pending], rid: str) -> Iterator[dict[str, Any]]:
        state = pending[rid]
        done = False
        try:
            while not done:
                self._advance(pending)
                with self._lock:
                    chunks, state.chunks = state.chunks, []
                for delta, num_ids, finished in chunks:
                    done = done or finished
                    yield {"text": delta, "output_ids": state.output_ids[:num_ids],
                           "meta_info": dict(state.meta), "finished": finished}
        finally:
            self._end_call(pending)  # (closed early: aborted)

    def abort(self, rid: str) -> None:
        self._check_open()
        with self._lock:
            self.scheduler.abort_request(rid)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Load the PEFT LoRA adapter folder `lora_path` into a free slot (--max-loras) under
        `lora_name`, which requests name as their lora_path from then on; ValueError with the
        reason when the slots cannot take it."""
        self._check_open()
        with self._lock:
            reply = self.scheduler.load_lora(lora_name, lora_path)
        if not reply.success:
            raise ValueError(reply.message)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Free `lora_name`'s slot; ValueError while requests of it are open (streams)."""
        self._check_open()
        with self._lock:
            reply = self.scheduler.unload_lora(lora_name)
        if not reply.success:
            raise ValueError(reply.message)

    def get_internal_state(self) -> dict[str, Any]:
        self._check_open()
        with self._lock:
            return vars(self.scheduler.get_internal_state())

    def shutdown(self) -> None:
        """Finish what is in flight; with tensor parallelism, stop the other ranks and leave
        the group (another Engine may then be built in this process)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._states.clear()  # streams still open end with "the Engine is shut down"
            self._drain()
        if self._followers:
            self._follower_watch.stop()
            self.scheduler.stop_followers()
            for process, _ in self._followers:
                process.join(timeout=30)
        # weights, KV pools and graphs go now, not when the last reference to the Engine does
        self._runner.shutdown()
        self.scheduler = self._runner = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _is_single(prompt: Any, input_ids: Any) -> bool:
    """One prompt (a string, or one list of token ids) rather than a batch."""
    if prompt is not None:
        return isinstance(prompt, str)
    return input_ids is not None and _id_lists(input_ids) is None


def _id_lists(input_ids: Any) -> list[Any] | None:
    """input_ids as a batch of id sequences, or None where it is one sequence (ints, a 1-D
    array or tensor)."""
    if hasattr(input_ids, "ndim") and hasattr(input_ids, "tolist"):  # numpy / torch
        return list(input_ids) if input_ids.ndim > 1 else None
    if not isinstance(input_ids, (list, tuple)):
        raise InvalidRequestError("input_ids must be a list of token ids or a list of such "
                                  "lists")
    if input_ids and isinstance(input_ids[0], (list, tuple)) or (
            input_ids and hasattr(input_ids[0], "tolist") and getattr(input_ids[0], "ndim", 0)):
        return list(input_ids)
    return None


def _token_ids(ids: Any) -> list[int]:
    """One sequence of token ids as Python ints (numpy / torch integers accepted; floats,
    bools and strings refused)."""
    values = ids.tolist() if hasattr(ids, "tolist") else ids
    if not isinstance(values, (list, tuple)):
        raise InvalidRequestError("input_ids must be a list of token ids or a list of such "
                                  "lists")
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            if hasattr(value, "item") and not isinstance(value, bool):
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRequestError(f"token ids must be integers, got {value!r}")
        out.append(int(value))
    return out
