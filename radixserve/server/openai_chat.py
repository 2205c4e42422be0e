"""POST /v1/chat/completions: the tokenizer's chat template, n, stop, logprobs/top_logprobs,
max_tokens / max_completion_tokens, seed, streaming with stream_options.include_usage."""
from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from radixserve.server.errors import APIError
from radixserve.server.openai_common import (OpenAIContext, finish_reason_of, new_id, now_s,
                                             sample_copies, sse, sse_response, usage_of)
from radixserve.server.openai_protocol import ChatCompletionRequest, parse_model
from radixserve.server.request_state import GenerateRequest, ReqOutput


def render_prompt(ctx: OpenAIContext, body: ChatCompletionRequest) -> tuple[str, list[int]]:
    tokenizer = ctx.tokenizer_manager.tokenizer
    if tokenizer is None:
        raise APIError("chat needs a tokenizer; the server runs with --skip-tokenizer-init")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("the model has no chat template; use /v1/completions")
    try:
        prompt = tokenizer.apply_chat_template(body.conversation(), tokenize=False,
                                               add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's input errors
        raise APIError(f"the chat template rejected the messages: {exc}",
                       param="messages") from exc
    # the template writes BOS itself where the model wants one
    return prompt, list(tokenizer.encode(prompt, add_special_tokens=False))


def build_requests(ctx: OpenAIContext, body: ChatCompletionRequest) -> list[GenerateRequest]:
    tm = ctx.tokenizer_manager
    prompt, input_ids = render_prompt(ctx, body)
    max_tokens = body.requested_max_tokens
    if max_tokens is None:  # OpenAI: up to the context length
        max_tokens = max(tm.limits.context_len - len(input_ids), 0)
    req = tm.make_request(
        text=prompt, input_ids=input_ids,
        sampling_params=body.sampling_params(max_tokens, tm.generation_defaults),
        return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0,
        return_text_in_logprobs=True, stream=body.stream, param="messages")
    return sample_copies(req, body.n)


def logprob_content(entries: list[Any], tops: list[Any]) -> list[dict[str, Any]]:
    content = []
    for i, (logprob, _tid, text) in enumerate(entries):
        text = text or ""
        top = tops[i] if i < len(tops) and tops[i] is not None else []
        content.append({
            "token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": t or "", "logprob": lp,
                              "bytes": list((t or "").encode("utf-8"))} for lp, _, t in top]})
    return content


def choice_of(body: ChatCompletionRequest, index: int, out: ReqOutput) -> dict[str, Any]:
    logprobs = None
    if body.logprobs:
        logprobs = {"content": logprob_content(out.meta_info.get("output_token_logprobs") or [],
                                               out.meta_info.get("output_top_logprobs") or [])}
    return {"index": index, "message": {"role": "assistant", "content": out.text},
            "logprobs": logprobs, "finish_reason": finish_reason_of(out)}


async def create_chat_completion(ctx: OpenAIContext, request: Request, raw: Any) -> Response:
    tm = ctx.tokenizer_manager
    body: ChatCompletionRequest = await tm.offload(parse_model, ChatCompletionRequest, raw)
    body.check_unsupported()
    model = ctx.check_model(body.model)
    reqs = await tm.offload(build_requests, ctx, body)  # template + tokenizer off the loop
    if body.stream:
        return await sse_response(stream_events(ctx, body, model, reqs, request))
    outs = await ctx.tokenizer_manager.generate_all(reqs, request)
    return JSONResponse({
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": now_s(),
        "model": model, "choices": [choice_of(body, i, o) for i, o in enumerate(outs)],
        "usage": usage_of(outs, body.n)})


async def stream_events(ctx: OpenAIContext, body: ChatCompletionRequest, model: str,
                        reqs: list[GenerateRequest], request: Request) -> AsyncIterator[str]:
    response_id, created = new_id("chatcmpl"), now_s()

    def chunk(index: int, delta: dict[str, Any], reason: str | None = None,
              logprobs: Any = None) -> str:
        return sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [{"index": index, "delta": delta,
                                                 "logprobs": logprobs,
                                                 "finish_reason": reason}]})

    sent_text = [0] * len(reqs)
    sent_logprobs = [0] * len(reqs)
    started = [False] * len(reqs)
    finals: list[ReqOutput | None] = [None] * len(reqs)
    merged = ctx.tokenizer_manager.generate_merged(reqs, request)
    async with contextlib.aclosing(merged) as outputs:
        async for index, out in outputs:
            if not started[index]:
                started[index] = True
                yield chunk(index, {"role": "assistant", "content": ""})
            text = out.text[sent_text[index]:]
            sent_text[index] = len(out.text)
            logprobs = None
            if body.logprobs:
                tokens = out.meta_info.get("output_token_logprobs") or []
                tops = out.meta_info.get("output_top_logprobs") or []
                start = sent_logprobs[index]
                sent_logprobs[index] = len(tokens)
                logprobs = {"content": logprob_content(tokens[start:], tops[start:])}
            if text or (logprobs and logprobs["content"]):
                yield chunk(index, {"content": text}, None, logprobs)
            if out.finished:
                finals[index] = out
                yield chunk(index, {}, finish_reason_of(out))
    if body.include_usage:
        done = [o for o in finals if o is not None]
        yield sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                   "model": model, "choices": [], "usage": usage_of(done, body.n)})
