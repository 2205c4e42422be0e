"""POST /v1/completions: prompt as a string, list of strings, token ids or lists of token ids;
echo, logprobs, n, stop, streaming with usage. Choice i*n + j is sample j of prompt i."""
from __future__ import annotations

import codecs
import contextlib
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from radixserve.server.openai_common import (OpenAIContext, finish_reason_of, new_id, now_s,
                                             sample_copies, sse, sse_response, usage_of)
from radixserve.server.openai_protocol import (OPENAI_FIELD_NAMES, CompletionRequest,
                                               parse_model)
from radixserve.server.request_state import GenerateRequest, ReqOutput
from radixserve.server.tokenizer_utils import token_bytes, token_texts

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
            field_names=OPENAI_FIELD_NAMES, lora_name=ctx.adapter_of(body),
            priority=body.priority)
        reqs.extend(sample_copies(req, body.n))
    return reqs


class LogprobBuilder:
    """OpenAI's completion logprobs: tokens, token_logprobs, top_logprobs, text_offset.

    With the tokenizer, a token is its own UTF-8 bytes: its text where they are whole
    characters, else OpenAI's "bytes:\\xe2\\x80" form (a character split over tokens; its
    text would be U+FFFD). text_offset counts the characters of the text before the token,
    decoded incrementally over every token so far (of this request, across stream chunks): a
    token that starts inside a character points at that character, and offsets never pass the
    text's end. Without it (--skip-tokenizer-init) tokens are the texts given."""

    def __init__(self, tokenizer: Any | None = None, start_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.offset = start_offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def build(self, token_entries: list[Any], top_entries: list[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        raw = self._bytes(token_entries, top_entries)
        names = {tid: openai_token_name(data) for tid, data in raw.items() if data is not None}
        for i, (logprob, tid, text) in enumerate(token_entries):
            name = names.get(tid, text or "")
            out["tokens"].append(name)
            out["token_logprobs"].append(logprob)
            top = top_entries[i] if i < len(top_entries) else None
            tops = {names.get(t, s or ""): lp for lp, t, s in top or ()}
            if logprob is not None:  # the chosen token is always listed (up to n + 1; with
                tops.setdefault(name, logprob)  # logprobs 0 alone, as vLLM lists it)
            out["top_logprobs"].append(None if top is None and logprob is None else tops)
            out["text_offset"].append(self.offset)
            data = raw.get(tid)
            self.offset += len(text or "") if data is None else len(self._decoder.decode(data))
        return out

    def _bytes(self, token_entries: list[Any], top_entries: list[Any]) -> dict[int, bytes | None]:
        """Each token id's bytes, chosen and top alike (empty without a tokenizer)."""
        ids = {tid for _, tid, _ in token_entries}
        ids.update(tid for top in top_entries if top for _, tid, _ in top)
        ordered = sorted(i for i in ids if isinstance(i, int))
        if self.tokenizer is None or not ordered:
            return {}
        return dict(zip(ordered, token_bytes(self.tokenizer, ordered)))


def openai_token_name(data: bytes) -> str:
    """A token's name in OpenAI's completion logprobs: its text where its bytes are whole
    UTF-8 characters, else "bytes:" and each byte as \\xNN."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


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
        builder = LogprobBuilder(ctx.tokenizer_manager.tokenizer)
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
    lane = await tm.lanes.lane_for(request, raw)
    body: CompletionRequest = await tm.lanes.offload(parse_model, CompletionRequest, raw, lane=lane)
    body.check_unsupported()
    model = ctx.check_model(body.model)
    # tokenisation off the event loop
    reqs = await tm.lanes.offload(build_requests, ctx, body, lane=lane)
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
    builders = [LogprobBuilder(ctx.tokenizer_manager.tokenizer) for _ in reqs]
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
