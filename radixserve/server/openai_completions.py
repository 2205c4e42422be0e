"""POST /v1/completions: prompt as a string, list of strings, token ids or lists of token ids;
echo, logprobs, n, stop, streaming with usage. Choice i*n + j is sample j of prompt i."""
from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from radixserve.server.http_utils import body_bytes
from radixserve.server.openai_common import (OpenAIContext, finish_reason_of, new_id, now_s,
                                             sample_copies, sse, sse_response, usage_of)
from radixserve.server.openai_protocol import (OPENAI_FIELD_NAMES, CompletionRequest,
                                               parse_model)
from radixserve.server.request_state import GenerateRequest, ReqOutput
from radixserve.server.tokenizer_utils import token_texts

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def build_requests(ctx: OpenAIContext, body: CompletionRequest) -> list[GenerateRequest]:
    tm = ctx.tokenizer_manager
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    reqs: list[GenerateRequest] = []
    for prompt in body.prompts():
        req = tm.make_request(
            text=prompt if isinstance(prompt, str) else None,
            input_ids=None if isinstance(prompt, str) else prompt,
            sampling_params=body.sampling_params(max_tokens, tm.generation_defaults),
            return_logprob=body.logprobs is not None,
            logprob_start_len=0 if (body.echo and body.logprobs is not None) else -1,
            top_logprobs_num=body.logprobs or 0, return_text_in_logprobs=True,
            stream=body.stream, param="prompt",
            grammar_param=body.grammar_field(),
            field_names=OPENAI_FIELD_NAMES)
        reqs.extend(sample_copies(req, body.n))
    return reqs


class LogprobBuilder:
    """OpenAI's completion logprobs: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, start_offset: int = 0) -> None:
        self.offset = start_offset

    def build(self, token_entries: list[Any], top_entries: list[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for i, (logprob, _tid, text) in enumerate(token_entries):
            text = text or ""
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            top = top_entries[i] if i < len(top_entries) else None
            tops = None if top is None else {t or "": lp for lp, _, t in top}
            if tops is not None and logprob is not None:
                tops.setdefault(text, logprob)  # the chosen token is always listed (up to n + 1)
            out["top_logprobs"].append(tops)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def input_logprobs(ctx: OpenAIContext, req: GenerateRequest,
                   meta: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """Prompt token logprobs for echo, one entry per prompt token: the first token has no
    logprob (None), which the scheduler may leave out."""
    tokens = list(meta.get("input_token_logprobs") or [])
    tops = list(meta.get("input_top_logprobs") or [])
    if len(tokens) == len(req.input_ids) - 1:
        first = req.input_ids[0]
        text = token_texts(ctx.tokenizer_manager.tokenizer, [first])[0]
        tokens.insert(0, (None, first, text))
        if tops:
            tops.insert(0, None)
    tops += [None] * (len(tokens) - len(tops))
    return tokens, tops


def prompt_text(ctx: OpenAIContext, req: GenerateRequest) -> str:
    if req.input_text is not None:
        return req.input_text
    tokenizer = ctx.tokenizer_manager.tokenizer
    return tokenizer.decode(req.input_ids) if tokenizer is not None else ""


def choice_of(ctx: OpenAIContext, body: CompletionRequest, index: int, req: GenerateRequest,
              out: ReqOutput) -> dict[str, Any]:
    text = out.text
    logprobs = None
    meta = out.meta_info
    if body.echo:
        echo_text = prompt_text(ctx, req)
        text = echo_text + text
    if body.logprobs is not None:
        builder = LogprobBuilder()
        tokens = list(meta.get("output_token_logprobs") or [])
        tops = list(meta.get("output_top_logprobs") or [])
        if body.echo:
            in_tokens, in_tops = input_logprobs(ctx, req, meta)
            tokens, tops = in_tokens + tokens, in_tops + tops
        logprobs = builder.build(tokens, tops if body.logprobs else [])
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason_of(out)}


async def create_completion(ctx: OpenAIContext, request: Request, raw: Any) -> Response:
    tm = ctx.tokenizer_manager
    size = await body_bytes(request)
    body: CompletionRequest = await tm.offload(parse_model, CompletionRequest, raw,
                                               body_bytes=size)
    body.check_unsupported()
    model = ctx.check_model(body.model)
    # tokenisation off the event loop
    reqs = await tm.offload(build_requests, ctx, body, body_bytes=size)
    if body.stream:
        return await sse_response(stream_events(ctx, body, model, reqs, request))
    outs = await tm.generate_all(reqs, request)
    return JSONResponse({
        "id": new_id("cmpl"), "object": "text_completion", "created": now_s(), "model": model,
        "choices": [choice_of(ctx, body, i, r, o) for i, (r, o) in enumerate(zip(reqs, outs))],
        "usage": usage_of(outs, body.n)})


async def stream_events(ctx: OpenAIContext, body: CompletionRequest, model: str,
                        reqs: list[GenerateRequest], request: Request) -> AsyncIterator[bytes]:
    response_id, created = new_id("cmpl"), now_s()
    sent_text = [0] * len(reqs)
    sent_logprobs = [0] * len(reqs)
    echoed = [False] * len(reqs)
    builders = [LogprobBuilder() for _ in reqs]
    finals: list[ReqOutput | None] = [None] * len(reqs)
    merged = ctx.tokenizer_manager.generate_merged(reqs, request)
    async with contextlib.aclosing(merged) as outputs:
        async for index, out in outputs:
            meta = out.meta_info
            text = out.text[sent_text[index]:]
            sent_text[index] = len(out.text)
            logprobs = None
            if body.logprobs is not None:
                tokens = list(meta.get("output_token_logprobs") or [])
                tops = list(meta.get("output_top_logprobs") or [])
                start = sent_logprobs[index]
                sent_logprobs[index] = len(tokens)
                tokens, tops = tokens[start:], tops[start:]
                if body.echo and not echoed[index]:
                    in_tokens, in_tops = input_logprobs(ctx, reqs[index], meta)
                    tokens, tops = in_tokens + tokens, in_tops + tops
                logprobs = builders[index].build(tokens, tops if body.logprobs else [])
            if body.echo and not echoed[index]:
                text = prompt_text(ctx, reqs[index]) + text
                echoed[index] = True
            reason = finish_reason_of(out) if out.finished else None
            if out.finished:
                finals[index] = out
            if not text and reason is None and not (logprobs and logprobs["tokens"]):
                continue
            yield sse({"id": response_id, "object": "text_completion", "created": created,
                       "model": model, "choices": [{"index": index, "text": text,
                                                    "logprobs": logprobs,
                                                    "finish_reason": reason}]})
    if body.include_usage:
        done = [o for o in finals if o is not None]
        yield sse({"id": response_id, "object": "text_completion", "created": created,
                   "model": model, "choices": [], "usage": usage_of(done, body.n)})
