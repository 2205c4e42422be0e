"""Pieces shared by the OpenAI completions and chat handlers: model check, n-expansion,
usage, finish reasons, and Server-Sent Events."""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

import orjson
from fastapi.responses import StreamingResponse

from radixserve.server.errors import APIError, ClientDisconnected
from radixserve.server.reasoning import ReasoningFormat
from radixserve.server.request_state import GenerateRequest, ReqOutput
from radixserve.server.responses_store import ResponseStore
from radixserve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


@dataclass
class OpenAIContext:
    tokenizer_manager: TokenizerManager
    model_name: str
    model_aliases: frozenset[str]
    tool_call_parser: str | None = None  # --tool-call-parser; None: from the chat template
    exclude_tools_when_tool_choice_none: bool = False  # --exclude-tools-when-tool-choice-none
    reasoning: ReasoningFormat | None = None  # --reasoning-parser
    is_embedding: bool = False  # --is-embedding: /v1/embeddings serves, generation does not
    # /v1/responses kept for previous_response_id and GET / DELETE (responses_store.py)
    responses: ResponseStore = field(default_factory=ResponseStore)

    def check_model(self, requested: str | None) -> str:
        """The model a request names: the base model (its name or an alias), or a LoRA
        adapter by its --lora-paths name (as vLLM serves them); else 404."""
        if requested is None or requested in self.model_aliases:
            return self.model_name
        if requested in self.tokenizer_manager.limits.lora_names:
            return requested
        raise APIError(f"The model `{requested}` does not exist. This server serves "
                       f"`{self.model_name}`.", status_code=404, param="model",
                       code="model_not_found")

    def adapter_of(self, body: Any) -> str | None:
        """A request's LoRA adapter: its `model` naming one (vLLM's way), or SGLang's
        `lora_path` extra field with the base model's name (both naming different ones is a
        400)."""
        by_model = self.lora_name(body.model)
        by_field = getattr(body, "lora_path", None)
        if by_field is not None and by_model is not None and by_field != by_model:
            raise APIError(f"model names the LoRA adapter {by_model!r} and lora_path "
                           f"{by_field!r}: give one", param="lora_path")
        return by_model or by_field

    def lora_name(self, requested: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, or None (the base model, whose names
        win over an adapter named alike, as in check_model). Not checked against the loaded
        adapters again: check_model did, and the request's validation does once more when
        it is built, so an adapter unloaded in between is a 400, never the base model's
        answer under the adapter's name."""
        if requested is None or requested in self.model_aliases:
            return None
        return requested


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def sample_copies(req: GenerateRequest, n: int) -> list[GenerateRequest]:
    """n samples of one prompt (SamplingParams.for_sample: with a seed, sample j uses
    seed + j)."""
    if n == 1:
        return [req]
    return [replace(req, rid=uuid.uuid4().hex, sampling_params=req.sampling_params.for_sample(j))
            for j in range(n)]


def finish_reason_of(out: ReqOutput) -> str | None:
    reason = out.meta_info.get("finish_reason")
    if not reason:
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type"), "abort")


def usage_of(outputs: list[ReqOutput], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (samples of one prompt share it)."""
    prompt_tokens = sum(o.meta_info["prompt_tokens"] for o in outputs[::n])
    completion_tokens = sum(o.meta_info["completion_tokens"] for o in outputs)
    cached_tokens = sum(int(o.meta_info.get("cached_tokens") or 0) for o in outputs[::n])
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(data: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event. orjson writes UTF-8 as json.dumps(ensure_ascii=False) would, ~5x
    faster (a native /generate chunk carries every output id so far); non-finite floats
    (a -inf logprob) become null, which standard JSON parsers accept."""
    payload = data.encode() if isinstance(data, str) else orjson.dumps(
        data, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    return b"data: " + payload + b"\n\n"


async def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    """Stream `events` (already formatted) and a final "data: [DONE]".

    The first event is awaited before the response starts, so that errors found up to then
    (bad input, full queue) still get their proper status code. Errors after that are sent as
    an error event, since the status line is already out."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield first
                async for event in events:
                    yield event
            yield sse("[DONE]")
        except APIError as exc:
            yield sse(exc.to_json())
            yield sse("[DONE]")
        except ClientDisconnected:
            return
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
