"""POST /v1/chat/completions: the tokenizer's chat template (add_generation_prompt,
continue_final_message, chat_template_kwargs), n, stop, logprobs/top_logprobs,
max_tokens / max_completion_tokens, seed, response_format, tools (openai_tools.py), streaming
with stream_options.include_usage and tool-call deltas."""
from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from radixserve.server.errors import APIError
from radixserve.server.harmony import CONSTRAINED_ANSWER, HARMONY_ASSISTANT, with_call_end
from radixserve.server.image_inputs import fetch_images
from radixserve.server.openai_common import (OpenAIContext, finish_reason_of, new_id, now_s,
                                             sample_copies, sse, sse_response, usage_of)
from radixserve.server.openai_protocol import (OPENAI_FIELD_NAMES, ChatCompletionRequest,
                                               ImageRendering, parse_model)
from radixserve.server.openai_tools import (ToolPlan, kept_special_tokens, plan_tools,
                                            render_conversation, tool_message)
from radixserve.server.reasoning import (ReasoningFormat, ReasoningSplit, ReasoningStream,
                                        plan_split, reasoning_gate, split_reasoning)
from radixserve.server.tokenizer_utils import special_token_ids, token_bytes
from radixserve.server.tool_parsers.streaming import ToolCallStream
from radixserve.server.request_state import GenerateRequest, ReqOutput


def render_prompt(ctx: OpenAIContext, body: ChatCompletionRequest) -> tuple[str, list[int],
                                                                           ToolPlan]:
    """The prompt's text and ids (images' markers not yet expanded) and its tool plan."""
    tokenizer = ctx.tokenizer_manager.tokenizer
    if tokenizer is None:
        raise APIError("chat needs a tokenizer; the server runs with --skip-tokenizer-init")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise APIError("the model has no chat template; use /v1/completions")
    template = template if isinstance(template, str) else json.dumps(template)
    plan = plan_tools(body, ctx.tool_call_parser, template,
                      ctx.exclude_tools_when_tool_choice_none)
    reader = getattr(ctx.tokenizer_manager, "images", None)  # (a stand-in may have none)
    images = None if reader is None else \
        ImageRendering.for_template(template, reader.spec.image_marker)
    messages = render_conversation(body, plan, template, images)
    tools = plan.tools if plan.tools and "tools" in template else None
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                               **body.template_kwargs())
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's input errors
        raise APIError(f"the chat template rejected the messages: {exc}",
                       param="messages") from exc
    if reader is not None:
        prompt = reader.expand_text(prompt, len(body.image_sources()))
    # the template writes BOS itself where the model wants one
    return prompt, list(tokenizer.encode(prompt, add_special_tokens=False)), plan


def build_requests(ctx: OpenAIContext, body: ChatCompletionRequest, images: list[Any] = ()
                   ) -> tuple[list[GenerateRequest], ToolPlan, ReasoningSplit | None]:
    """The request's samples, its tool plan and how its output splits into reasoning
    (`images`: the conversation's, fetched)."""
    tm = ctx.tokenizer_manager
    prompt, input_ids, plan = render_prompt(ctx, body)
    reasoning = reasoning_of(ctx, body)
    if reasoning is not None and reasoning.harmony and body.grammar() and \
            prompt.endswith(HARMONY_ASSISTANT):
        # gpt-oss with response_format: the final message, constrained from its start
        prompt += CONSTRAINED_ANSWER
        input_ids = list(tm.tokenizer.encode(prompt, add_special_tokens=False))
    mm_inputs = None
    reader = getattr(tm, "images", None)
    if reader is not None:
        input_ids, mm_inputs = reader.prepare(input_ids, list(images))
    max_tokens = body.requested_max_tokens
    if max_tokens is None:  # OpenAI: up to the context length (or what the KV cache holds)
        max_tokens = max(tm.limits.max_sequence_tokens - len(input_ids), 0)
    params = body.sampling_params(max_tokens, tm.generation_defaults)
    if plan.forced_ebnf is not None:
        params.ebnf = plan.forced_ebnf
    params.keep_special_tokens = kept_special_tokens(plan, tm.tokenizer) + \
        kept_reasoning_tags(reasoning, tm.tokenizer)
    constrained = params.grammar_key is not None
    if reasoning is not None and constrained:  # it constrains the answer
        params.reasoning_gate = reasoning_gate(reasoning, tm.tokenizer, prompt)
    split = plan_split(reasoning, prompt, constrained, params.reasoning_gate,
                       plan.parse_output, tm.tokenizer, plan.forced_ebnf is not None)
    req = tm.make_request(
        text=prompt, input_ids=input_ids, sampling_params=params,
        return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0,
        return_text_in_logprobs=True, stream=body.stream, param="messages",
        grammar_param="tool_choice" if plan.forced_ebnf else body.grammar_field(),
        field_names=OPENAI_FIELD_NAMES, lora_name=ctx.adapter_of(body),
        priority=body.priority, mm_inputs=mm_inputs)
    return sample_copies(req, body.n), plan, split


def logprob_content(tokenizer: Any | None, entries: list[Any],
                    tops: list[Any]) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs; `bytes` are each token's own UTF-8 bytes (`token_bytes`), so
    a token holding part of a character does not report U+FFFD's."""
    tops = [tops[i] if i < len(tops) and tops[i] is not None else [] for i in range(len(entries))]
    ids = [tid for _, tid, _ in entries] + [tid for top in tops for _, tid, _ in top]
    raw = iter(token_bytes(tokenizer, ids))
    entry_bytes = [next(raw) for _ in entries]
    content = []
    for (logprob, _tid, text), own, top in zip(entries, entry_bytes, tops):
        text = text or ""
        content.append({
            "token": text, "logprob": logprob, "bytes": _bytes_of(own, text),
            "top_logprobs": [{"token": t or "", "logprob": lp, "bytes": _bytes_of(next(raw), t)}
                             for lp, _, t in top]})
    return content


def _bytes_of(token: bytes | None, text: str | None) -> list[int]:
    return list(token if token is not None else (text or "").encode("utf-8"))


def reasoning_of(ctx: OpenAIContext, body: ChatCompletionRequest) -> ReasoningFormat | None:
    """The reasoning format this request's output is split by (--reasoning-parser, unless
    the request asks for no separate reasoning; gpt-oss's channels always: its raw output is
    no answer)."""
    harmony = ctx.reasoning is not None and ctx.reasoning.harmony
    return ctx.reasoning if body.separate_reasoning or harmony else None


def kept_reasoning_tags(fmt: ReasoningFormat | None, tokenizer: Any | None) -> tuple[str, ...]:
    """The think tags that are special tokens of the tokenizer: the output text must keep
    them to be split (decoding with skip_special_tokens would drop them)."""
    if fmt is None or tokenizer is None:
        return ()
    special = special_token_ids(tokenizer)
    return tuple(tag for tag in fmt.tags if tag in special)


def output_text(out: ReqOutput, split: ReasoningSplit | None) -> str:
    """The output's text as its split reads it: gpt-oss's with `<|call|>` back where that EOS
    ended it."""
    if split is None or not split.fmt.harmony or not out.finished:
        return out.text
    return with_call_end(out.text, out.meta_info.get("finish_reason"), split.call_token,
                         split.forced_call)


def chat_finish_reason(out: ReqOutput, called: bool) -> str | None:
    """"tool_calls" when the answer called tools, unless max_tokens cut it off: "length"
    then, as OpenAI answers, so a client knows the calls or the text after them may be cut."""
    reason = finish_reason_of(out)
    return "tool_calls" if called and reason != "length" else reason


def choice_of(body: ChatCompletionRequest, plan: ToolPlan, index: int,
              out: ReqOutput, tokenizer: Any | None,
              split: ReasoningSplit | None = None,
              reasoning_field: bool = False) -> dict[str, Any]:
    """One choice of a whole answer; `reasoning_field`: the message carries
    reasoning_content (null where nothing of it was reasoning), as every answer of a server
    that separates reasoning does, constrained ones included."""
    logprobs = None
    if body.logprobs:
        logprobs = {"content": logprob_content(tokenizer,
                                               out.meta_info.get("output_token_logprobs") or [],
                                               out.meta_info.get("output_top_logprobs") or [])}
    thought, answer = (split_reasoning(split.fmt, output_text(out, split), True,
                                       split.inside, split.keep_calls)
                       if split else (None, out.text))
    thought = thought or None  # "</think>" first: no reasoning, as a stream sends none
    message, called = tool_message(plan, answer, cut=finish_reason_of(out) == "length")
    if split is not None or reasoning_field:  # null where there was no reasoning, as vLLM
        message["reasoning_content"] = thought
        if thought is not None and not answer and not called:
            message["content"] = None
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": chat_finish_reason(out, called)}


async def create_chat_completion(ctx: OpenAIContext, request: Request, raw: Any) -> Response:
    tm = ctx.tokenizer_manager
    lane = await tm.lanes.lane_for(request, raw)
    body: ChatCompletionRequest = await tm.lanes.offload(parse_model, ChatCompletionRequest, raw,
                                                   lane=lane)
    body.check_unsupported()
    model = ctx.check_model(body.model)
    images = await fetch_images(tm.images, body.image_sources(), "messages")
    # template + tokenizer (and images' pixels) off the loop
    reqs, plan, split = await tm.lanes.offload(build_requests, ctx, body, images, lane=lane)
    if body.stream:
        return await sse_response(stream_events(ctx, body, plan, split, model, reqs,
                                                request))
    outs = await ctx.tokenizer_manager.generate_all(reqs, request)
    return JSONResponse({
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": now_s(),
        "model": model,
        "choices": [choice_of(body, plan, i, o, tm.tokenizer, split,
                              reasoning_of(ctx, body) is not None)
                    for i, o in enumerate(outs)],
        "usage": usage_of(outs, body.n)})


async def stream_events(ctx: OpenAIContext, body: ChatCompletionRequest, plan: ToolPlan,
                        split: ReasoningSplit | None, model: str, reqs: list[GenerateRequest],
                        request: Request) -> AsyncIterator[bytes]:
    response_id, created = new_id("chatcmpl"), now_s()

    def chunk(index: int, delta: dict[str, Any], reason: str | None = None,
              logprobs: Any = None) -> bytes:
        return sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [{"index": index, "delta": delta,
                                                 "logprobs": logprobs,
                                                 "finish_reason": reason}]})

    sent_text = [0] * len(reqs)
    sent_logprobs = [0] * len(reqs)
    started = [False] * len(reqs)
    finals: list[ReqOutput | None] = [None] * len(reqs)
    tool_streams = [ToolCallStream(plan.parser, plan.max_calls) if plan.parse_output else None
                    for _ in reqs]
    thought_streams = [ReasoningStream(split) if split else None for _ in reqs]
    merged = ctx.tokenizer_manager.generate_merged(reqs, request)
    async with contextlib.aclosing(merged) as outputs:
        async for index, out in outputs:
            if not started[index]:
                started[index] = True
                yield chunk(index, {"role": "assistant", "content": ""})
            tool_stream, thought_stream = tool_streams[index], thought_streams[index]
            tool_deltas: list[dict[str, Any]] = []
            thought, answer = "", out.text
            if thought_stream is not None:  # the answer so far, and the reasoning's delta
                thought, answer = thought_stream.update(output_text(out, split),
                                                        out.finished)
            if tool_stream is None:
                text = answer[sent_text[index]:]
                sent_text[index] = len(answer)
            else:
                text, tool_deltas = tool_stream.update(answer, out.finished)
            logprobs = None
            if body.logprobs:
                tokens = out.meta_info.get("output_token_logprobs") or []
                tops = out.meta_info.get("output_top_logprobs") or []
                start = sent_logprobs[index]
                sent_logprobs[index] = len(tokens)
                logprobs = {"content": logprob_content(ctx.tokenizer_manager.tokenizer,
                                                       tokens[start:], tops[start:])}
            delta: dict[str, Any] = {"reasoning_content": thought} if thought else {}
            if text or (not thought and logprobs and logprobs["content"]):
                delta["content"] = text
            if delta:
                yield chunk(index, delta, None, logprobs)
            if tool_deltas:
                yield chunk(index, {"tool_calls": tool_deltas})
            if out.finished:
                finals[index] = out
                called = tool_stream is not None and tool_stream.has_calls
                yield chunk(index, {}, chat_finish_reason(out, called))
    if body.include_usage:
        done = [o for o in finals if o is not None]
        yield sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                   "model": model, "choices": [], "usage": usage_of(done, body.n)})
