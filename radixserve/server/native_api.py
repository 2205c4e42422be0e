"""Native (SGLang-style) routes: /generate, /health, /health_generate, /get_model_info,
/get_server_info, /flush_cache, /abort_request, /metrics.

/generate takes `text` or `input_ids`, single or batched (lists), with per-item or shared
sampling_params, rid, return_logprob, logprob_start_len, top_logprobs_num. Its response is
{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
"cached_tokens", "finish_reason", logprobs...}}, or a list of those for a batch or n > 1
(item i*n + j is sample j of prompt i). Streamed chunks (SSE) carry the same object with the
text so far, plus "index" for batches; the stream ends with "data: [DONE]".
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import StrictBool, StrictInt, StrictStr
from starlette.requests import Request
from starlette.types import Scope

from radixserve.core.sampling_params import MAX_N, InvalidRequestError, SamplingParams
from radixserve.server.errors import APIError
from radixserve.server.http_utils import read_json
from radixserve.server.image_inputs import fetch_images
from radixserve.server.metrics import CONTENT_TYPE
from radixserve.server.openai_common import sample_copies, sse, sse_response
from radixserve.server.openai_embeddings import NOT_A_GENERATION_MODEL
from radixserve.server.openai_protocol import StrictModel, parse_model
from radixserve.server.request_state import GenerateRequest
from radixserve.server.tokenizer_manager import TokenizerManager

HEALTH_GENERATE_TIMEOUT_S = 30.0
# the header of the server's own warm-up /generate (launch.py), heeded only before it is ready
WARM_UP_HEADER = "x-radixserve-warm-up"


def is_warm_up(scope: Scope, is_ready: Callable[[], bool]) -> bool:
    """The server's own warm-up request (launch.py): marked by WARM_UP_HEADER, and believed
    only before the server is ready."""
    return not is_ready() and (WARM_UP_HEADER.encode(), b"1") in scope.get("headers", ())


UNSUPPORTED_NATIVE_FIELDS = (
    "input_embeds", "audio_data", "video_data", "modalities",
    "lora_id", "session_params", "custom_logit_processor", "return_hidden_states",
    "token_ids_logprob", "data_parallel_rank", "bootstrap_host", "bootstrap_port",
    "bootstrap_room")


class GenerateReqInput(StrictModel):
    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: StrictStr | list[StrictStr] | None = None
    return_logprob: StrictBool | list[StrictBool] = False
    logprob_start_len: StrictInt | list[StrictInt] = -1
    top_logprobs_num: StrictInt | list[StrictInt] = 0
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = False
    log_metrics: StrictBool = True  # accepted; the server always keeps its metrics
    # SGLang's other GenerateReqInput fields, for features this server does not have: clients
    # send them as null or at their default, which passes; any other value is a 400 naming it
    input_embeds: Any = None
    # a model that reads images: a prompt's image (URL, data URL, path in
    # --allowed-local-media-path, base64) or list of them; a batch: one such item per prompt
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    modalities: Any = None
    lora_path: StrictStr | list[StrictStr | None] | None = None  # a --lora-paths name
    priority: StrictInt | list[StrictInt | None] | None = None  # priority scheduling
    lora_id: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = False
    token_ids_logprob: Any = None
    data_parallel_rank: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None

    def check_unsupported(self) -> None:
        for name in UNSUPPORTED_NATIVE_FIELDS:
            value = getattr(self, name)
            default = type(self).model_fields[name].default
            if value is not None and value != default and value != []:
                raise APIError(f"{name} is not supported by this server", param=name)

    def batch_size(self) -> int | None:
        """None for a single prompt, else the number of prompts."""
        if (self.text is None) == (self.input_ids is None):
            raise APIError("give exactly one of text and input_ids")
        if isinstance(self.text, list):
            return len(self.text)
        if self.input_ids and isinstance(self.input_ids[0], list):
            return len(self.input_ids)
        return None

    def item(self, name: str, i: int, size: int) -> Any:
        """Field `name` for prompt i: lists are per prompt, anything else is shared."""
        value = getattr(self, name)
        per_prompt = isinstance(value, list)
        if name == "input_ids":
            per_prompt = bool(value) and isinstance(value[0], list)
        if not per_prompt:
            return value
        if len(value) != size:
            raise APIError(f"{name} has {len(value)} items for {size} prompts", param=name)
        return value[i]

    def image_sources(self) -> list[list[Any]]:
        """Each prompt's images (a batch's image_data holds one item per prompt)."""
        size = self.batch_size()
        data = self.image_data
        if size is None:
            data = [data]
        elif data is not None and (not isinstance(data, list) or len(data) != size):
            raise APIError(f"image_data must hold one item per prompt ({size})",
                           param="image_data")
        items = data if data is not None else [None] * size  # type: ignore[operator]
        return [[] if item is None else list(item) if isinstance(item, list) else [item]
                for item in items]


def build_requests(tm: TokenizerManager, obj: GenerateReqInput,
                   images: list[list[Any]] | None = None) -> tuple[list[GenerateRequest], bool]:
    """The scheduler requests of one /generate call, and whether the answer is a list
    (`images`: each prompt's, fetched)."""
    obj.check_unsupported()
    size = obj.batch_size()
    is_batch = size is not None
    if is_batch and size == 0:
        raise APIError("the batch is empty", param="text" if obj.text is not None else "input_ids")
    reqs: list[GenerateRequest] = []
    for i in range(size or 1):
        try:
            given = obj.item("sampling_params", i, size or 1)
            if given is None or isinstance(given, dict):  # unset fields: the model's defaults
                given = {**tm.generation_defaults, **(given or {})}
            params = SamplingParams.from_dict(given)
        except (InvalidRequestError, TypeError) as exc:
            raise APIError(str(exc), param="sampling_params") from exc
        n = params.n
        params = dataclasses.replace(params, n=1) if isinstance(n, int) else params
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise APIError(f"n must be an integer in [1, {MAX_N}], got {n!r}", param="n")
        text, input_ids = obj.item("text", i, size or 1), obj.item("input_ids", i, size or 1)
        mm_inputs = None
        if tm.images is not None:  # placeholders expanded (and checked) before validation
            given = images[i] if images else []
            ids = input_ids if input_ids is not None else \
                tm.tokenize(tm.images.expand_text(text, len(given))) if text else None
            if ids is not None:
                input_ids, mm_inputs = tm.images.prepare(ids, given)
        req = tm.make_request(
            text=text, input_ids=input_ids, mm_inputs=mm_inputs,
            sampling_params=params, rid=obj.item("rid", i, size or 1),
            return_logprob=obj.item("return_logprob", i, size or 1),
            logprob_start_len=obj.item("logprob_start_len", i, size or 1),
            top_logprobs_num=obj.item("top_logprobs_num", i, size or 1),
            return_text_in_logprobs=obj.return_text_in_logprobs, stream=obj.stream,
            param="text" if obj.text is not None else "input_ids",
            lora_name=obj.item("lora_path", i, size or 1),
            priority=obj.item("priority", i, size or 1))
        copies = sample_copies(req, n)
        if n > 1 and req.rid is not None and obj.rid is not None:
            copies = [dataclasses.replace(c, rid=f"{req.rid}-{j}") for j, c in enumerate(copies)]
        reqs.extend(copies)
        is_batch = is_batch or n > 1
    return reqs, is_batch


async def _stream_chunks(tm: TokenizerManager, reqs: list[GenerateRequest], is_batch: bool,
                         request: Request, incremental: bool) -> AsyncIterator[bytes]:
    """SSE chunks of each request's output: cumulative text and output_ids, or with
    `incremental` only what is new since that request's previous chunk (meta_info stays
    cumulative either way)."""
    sent_text = [0] * len(reqs)
    sent_ids = [0] * len(reqs)
    async with contextlib.aclosing(tm.generate_merged(reqs, request)) as outputs:
        async for index, out in outputs:
            if incremental:
                text, ids = out.text[sent_text[index]:], out.output_ids[sent_ids[index]:]
                sent_text[index], sent_ids[index] = len(out.text), len(out.output_ids)
                out = dataclasses.replace(out, text=text, output_ids=ids)
            chunk = out.to_json()
            if is_batch:
                chunk["index"] = index
            yield sse(chunk)


def native_router(tm: TokenizerManager, server_info: Callable[[], dict[str, Any]],
                  is_ready: Callable[[], bool],
                  incremental_streaming_output: bool = False,
                  is_embedding: bool = False) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        if is_embedding:
            raise APIError(NOT_A_GENERATION_MODEL)
        raw = await read_json(request)
        # validation and tokenisation off the event loop: a huge prompt must not stall /health
        lane = await tm.lanes.lane_for(request, raw)
        obj: GenerateReqInput = await tm.lanes.offload(parse_model, GenerateReqInput, raw,
                                                       lane=lane)
        images = [await fetch_images(tm.images, sources, "image_data")
                  for sources in obj.image_sources()]
        reqs, is_batch = await tm.lanes.offload(build_requests, tm, obj, images, lane=lane)
        if is_warm_up(request.scope, is_ready):
            # the server's own warm-up (launch.py): not a request the metrics count
            reqs = [dataclasses.replace(r, internal=True) for r in reqs]
        if obj.stream:
            return await sse_response(_stream_chunks(tm, reqs, is_batch, request,
                                                     incremental_streaming_output))
        outs = await tm.generate_all(reqs, request)
        result = [o.to_json() for o in outs]
        return JSONResponse(result if is_batch else result[0])

    @router.get("/health")
    async def health() -> Response:
        if not is_ready():
            return JSONResponse({"status": "starting"}, status_code=503)
        return Response(status_code=200)

    @router.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        ids = [tm.limits.vocab_size // 2 if tm.limits.vocab_size else 1] * 4
        # internal: a probe that polls this route does not count as requests in the metrics
        req = dataclasses.replace(tm.make_request(input_ids=ids, sampling_params=SamplingParams(
            max_new_tokens=0 if is_embedding else 1, temperature=0.0)), internal=True)
        try:
            await asyncio.wait_for(tm.generate_final(req, request), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError("generation did not finish in time", status_code=503) from None
        return Response(status_code=200)

    @router.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        info = server_info()
        return JSONResponse({"model_path": info["server_args"]["model_path"],
                             "served_model_name": info["served_model_name"],
                             "tokenizer_path": info["server_args"]["tokenizer_path"],
                             "is_generation": not is_embedding, **tm.model_info})

    @router.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        replicas = await tm.get_replica_states()
        state = tm.note_states(replicas)  # every replica answered: their merge
        return JSONResponse({**server_info(), "internal_state": dataclasses.asdict(state),
                             "replica_states": [dataclasses.asdict(r) for r in replicas],
                             "requests_in_flight_per_replica": list(tm.router.in_flight),
                             "num_in_flight_requests": len(tm.rid_to_state),
                             "pid": os.getpid()})

    @router.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        reply = await tm.flush_cache()
        return JSONResponse({"success": reply.success, "message": reply.message},
                            status_code=200 if reply.success else 400)

    @router.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        body = await read_json(request)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str) or not rid:
            raise APIError("give the request id to abort as {\"rid\": \"...\"}", param="rid")
        known = tm.abort_by_client(rid)
        return JSONResponse({"success": True, "rid": rid, "was_in_flight": known})

    @router.get("/metrics")
    async def metrics() -> Response:
        # the gauges are the schedulers' latest states sent unasked: a scrape never waits for
        # a scheduler's turn to end (a long prefill held one for seconds)
        return Response(tm.metrics.render(), media_type=CONTENT_TYPE)

    return router
