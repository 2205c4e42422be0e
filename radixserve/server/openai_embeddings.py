"""POST /v1/embeddings (OpenAI's) and POST /encode (SGLang's) for an embedding model
(--is-embedding): each input's vector, its last token's final hidden state L2-normalised.

`input` is a string, a list of strings, token ids or lists of token ids. `encoding_format`
"base64" (what the openai SDK asks for by default) sends each vector's float32 bytes, little
endian; `dimensions` keeps the first that many components and normalises them again (the
Matryoshka use of Qwen3-Embedding and its peers; on other models it is still a truncation)."""
from __future__ import annotations

import base64
import math
import struct
from typing import Any, Literal

from pydantic import StrictInt

from fastapi.responses import JSONResponse
from starlette.requests import Request

from radixserve.core.req import EMBEDDING_KEY
from radixserve.core.sampling_params import SamplingParams
from radixserve.server.errors import APIError
from radixserve.server.openai_common import OpenAIContext
from radixserve.server.openai_protocol import PromptType, StrictModel, parse_model, prompt_list
from radixserve.server.request_state import GenerateRequest, ReqOutput
from radixserve.server.tokenizer_manager import TokenizerManager

NOT_AN_EMBEDDING_MODEL = ("this server serves a generation model; start it with --is-embedding "
                          "to serve an embedding model")
NOT_A_GENERATION_MODEL = ("this server serves an embedding model (--is-embedding), which "
                          "generates no text: ask /v1/embeddings or /encode")


class EmbeddingRequest(StrictModel):
    input: PromptType
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input)


def build_requests(tm: TokenizerManager, inputs: list[str | list[int]],
                   param: str) -> list[GenerateRequest]:
    if not inputs:
        raise APIError(f"{param} must not be empty", param=param)
    params = SamplingParams(max_new_tokens=0)
    return [tm.make_request(text=item if isinstance(item, str) else None,
                            input_ids=None if isinstance(item, str) else item,
                            sampling_params=params, param=param) for item in inputs]


def vector_of(out: ReqOutput, dimensions: int | None = None) -> list[float]:
    """The request's embedding, cut to `dimensions` and normalised again when asked."""
    vector = out.meta_info.get(EMBEDDING_KEY)
    if vector is None:
        raise APIError("the request ended without an embedding", status_code=500)
    if dimensions is None or dimensions == len(vector):
        return vector
    if not 1 <= dimensions <= len(vector):
        raise APIError(f"dimensions must be in [1, {len(vector)}], got {dimensions}",
                       param="dimensions")
    cut = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in cut)) or 1.0
    return [x / norm for x in cut]


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def public_meta(out: ReqOutput) -> dict[str, Any]:
    return {k: v for k, v in out.meta_info.items() if k != EMBEDDING_KEY}


async def create_embedding(ctx: OpenAIContext, request: Request, raw: Any) -> JSONResponse:
    if not ctx.is_embedding:
        raise APIError(NOT_AN_EMBEDDING_MODEL, param="model")
    tm = ctx.tokenizer_manager
    lane = await tm.lanes.lane_for(request, raw)
    body: EmbeddingRequest = await tm.lanes.offload(parse_model, EmbeddingRequest, raw,
                                                    lane=lane)
    model_name = ctx.check_model(body.model)
    if body.dimensions is not None and body.dimensions < 1:
        raise APIError(f"dimensions must be >= 1, got {body.dimensions}", param="dimensions")
    reqs = await tm.lanes.offload(build_requests, tm, body.inputs(), "input", lane=lane)
    outs = await tm.generate_all(reqs, request)
    data = [{"object": "embedding", "index": i,
             "embedding": encoded(vector_of(out, body.dimensions), body.encoding_format)}
            for i, out in enumerate(outs)]
    tokens = sum(len(r.input_ids) for r in reqs)
    return JSONResponse({"object": "list", "data": data, "model": model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def encode(tm: TokenizerManager, is_embedding: bool, request: Request,
                 raw: Any) -> JSONResponse:
    """SGLang's /encode: {"text": str | [str]} or {"input_ids": ids | [ids]} ->
    {"embedding", "meta_info"} (a list for a list)."""
    if not is_embedding:
        raise APIError(NOT_AN_EMBEDDING_MODEL)
    if not isinstance(raw, dict) or ("text" in raw) == ("input_ids" in raw):
        raise APIError("give exactly one of text and input_ids")
    param = "text" if "text" in raw else "input_ids"
    value = raw[param]
    single = isinstance(value, str) or (isinstance(value, list) and bool(value)
                                        and isinstance(value[0], int))
    texts = isinstance(value, str) or (isinstance(value, list) and bool(value)
                                       and all(isinstance(v, str) for v in value))
    if (param == "text") != texts:
        raise APIError("text takes a string or a list of strings, input_ids token ids or "
                       "lists of token ids", param=param)
    try:
        body = EmbeddingRequest(input=value)
    except Exception:  # noqa: BLE001 - pydantic's verdict on the input's type
        raise APIError(f"{param} must be a string, a list of strings, token ids or lists of "
                       "token ids", param=param) from None
    lane = await tm.lanes.lane_for(request, raw)
    reqs = await tm.lanes.offload(build_requests, tm, body.inputs(), param, lane=lane)
    outs = await tm.generate_all(reqs, request)
    result = [{"embedding": vector_of(out), "meta_info": public_meta(out)} for out in outs]
    return JSONResponse(result[0] if single else result)
