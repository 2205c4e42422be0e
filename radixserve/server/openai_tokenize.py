"""POST /tokenize and /detokenize, as vLLM's OpenAI server has them.

/tokenize takes a `prompt` (special tokens added unless add_special_tokens is false), or chat
`messages` rendered by the chat template exactly as /v1/chat/completions renders them (with
add_generation_prompt, continue_final_message, chat_template_kwargs and tools; no special tokens
added unless asked: the template writes them). It answers the ids, their count, the context
length and, with return_token_strs, each id's vocabulary piece. /detokenize takes `tokens` and
answers their text as `prompt`.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, StrictInt, StrictStr

from radixserve.core.multimodal import expand_image_placeholders
from radixserve.core.sampling_params import InvalidRequestError
from radixserve.server.errors import APIError
from radixserve.server.openai_chat import render_prompt
from radixserve.server.openai_common import OpenAIContext
from radixserve.server.openai_protocol import (ChatCompletionRequest, ChatMessage, StrictModel,
                                               parse_model)


class TokenizePromptRequest(StrictModel):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(StrictModel):
    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none": rendered or not as on the chat route
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(StrictModel):
    model: StrictStr | None = None
    tokens: list[StrictInt]


def _tokenizer(ctx: OpenAIContext) -> Any:
    tokenizer = ctx.tokenizer_manager.tokenizer
    if tokenizer is None:
        raise APIError("the server runs with --skip-tokenizer-init: it has no tokenizer")
    return tokenizer


def tokenize(ctx: OpenAIContext, raw: Any) -> dict[str, Any]:
    """The /tokenize answer for a JSON body (runs in the request-building thread)."""
    tokenizer = _tokenizer(ctx)
    chat = isinstance(raw, dict) and "messages" in raw
    body = parse_model(TokenizeChatRequest if chat else TokenizePromptRequest, raw)
    ctx.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        fields = body.model_dump(exclude={"add_special_tokens", "return_token_strs", "model"},
                                 exclude_none=True)
        chat_body = parse_model(ChatCompletionRequest, fields)
        chat_body.check_unsupported()
        prompt, ids, _ = render_prompt(ctx, chat_body)
        if body.add_special_tokens:
            ids = list(tokenizer.encode(prompt, add_special_tokens=True))
        reader = getattr(ctx.tokenizer_manager, "images", None)
        if reader is not None:  # as the chat route sends it: each image's run at full length
            ids = _with_image_runs(reader, ids, chat_body.image_sources())
    else:
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    return {"count": len(ids), "max_model_len": ctx.tokenizer_manager.limits.context_len,
            "tokens": ids, "token_strs": tokenizer.convert_ids_to_tokens(ids)
            if body.return_token_strs else None}


def _with_image_runs(reader: Any, ids: list[int], sources: list[Any]) -> list[int]:
    """A chat prompt's ids with each image's placeholders at full length. Where an image's
    size decides its run (Pixtral's rows, Qwen-VL's grid) the images are read (in this
    request-building thread; a URL downloaded as the offline Engine does) and processed, as
    the chat route would; elsewhere the run is fixed."""
    if not (sources and reader.spec.sized_by_image):
        return expand_image_placeholders(ids, reader.spec, len(sources))[0]
    try:
        reader.check_count(len(sources))
        images = [reader.read_source(source, i) for i, source in enumerate(sources)]
        return reader.prepare(ids, images)[0]
    except InvalidRequestError as exc:
        raise APIError(str(exc), param="messages") from None


def detokenize(ctx: OpenAIContext, raw: Any) -> dict[str, Any]:
    """The /detokenize answer for a JSON body: ids outside the vocabulary are a 400."""
    tokenizer = _tokenizer(ctx)
    body = parse_model(DetokenizeRequest, raw)
    ctx.check_model(body.model)
    vocab = max(ctx.tokenizer_manager.limits.vocab_size, len(tokenizer))
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens)}
