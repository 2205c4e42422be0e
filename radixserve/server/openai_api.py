"""Routes of the OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions,
/v1/responses (and GET / DELETE of stored ones), /v1/embeddings (with SGLang's /encode), and
vLLM's /tokenize, /detokenize and /version."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

import radixserve
from radixserve.server.http_utils import read_json
from radixserve.server.openai_chat import create_chat_completion
from radixserve.server.openai_common import OpenAIContext, now_s
from radixserve.server.openai_completions import create_completion
from radixserve.server.openai_responses import create_response
from radixserve.server.errors import APIError
from radixserve.server.openai_embeddings import NOT_A_GENERATION_MODEL, create_embedding, encode
from radixserve.server.openai_tokenize import detokenize, tokenize


def openai_router(ctx: OpenAIContext, context_len: int) -> APIRouter:
    router = APIRouter()
    created = now_s()

    def model_card(name: str) -> dict[str, Any]:
        """/v1/models' entry for the base model or a LoRA adapter (with its parent)."""
        card = {"id": name, "object": "model", "created": created, "owned_by": "radixserve",
                "max_model_len": context_len}
        if ctx.lora_name(name) is not None:
            card["parent"] = ctx.model_name
        return card

    @router.get("/v1/models")
    async def list_models() -> JSONResponse:
        names = [ctx.model_name, *ctx.tokenizer_manager.limits.lora_names]
        return JSONResponse({"object": "list", "data": [model_card(name) for name in names]})

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        return JSONResponse(model_card(ctx.check_model(model_id)))

    def generation_route(create: Callable[..., Awaitable[Response]]
                         ) -> Callable[[Request], Awaitable[Response]]:
        """A generating route: refused on an embedding model, else `create`'s answer."""
        async def route(request: Request) -> Response:
            if ctx.is_embedding:
                raise APIError(NOT_A_GENERATION_MODEL, param="model")
            return await create(ctx, request, await read_json(request))
        return route

    for path, create in (("/v1/completions", create_completion),
                         ("/v1/chat/completions", create_chat_completion),
                         ("/v1/responses", create_response)):
        router.add_api_route(path, generation_route(create), methods=["POST"])

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        found = ctx.responses.response(response_id)
        if found is None:
            raise APIError(f"no stored response {response_id!r}", status_code=404)
        return JSONResponse(found)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        if not ctx.responses.delete(response_id):
            raise APIError(f"no stored response {response_id!r}", status_code=404)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await create_embedding(ctx, request, await read_json(request))

    @router.post("/encode")
    async def encode_route(request: Request) -> Response:
        return await encode(ctx.tokenizer_manager, ctx.is_embedding, request,
                            await read_json(request))

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        raw = await read_json(request)
        tm = ctx.tokenizer_manager
        return JSONResponse(await tm.lanes.offload(tokenize, ctx, raw,
                                             lane=await tm.lanes.lane_for(request, raw)))

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        raw = await read_json(request)
        tm = ctx.tokenizer_manager
        return JSONResponse(await tm.lanes.offload(detokenize, ctx, raw,
                                             lane=await tm.lanes.lane_for(request, raw)))

    @router.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": radixserve.__version__})

    return router
