"""The request side of POST /v1/responses (OpenAI's Responses API): its body translated into the
chat completion request the chat pipeline serves (openai_chat.py), with the Responses names
checked and refused by name where they mean something this server does not do.

  instructions            -> a system message first
  input (text or items)   -> messages: message items (input_text / output_text parts), each
                             function_call item into an assistant turn's tool_calls (adjacent
                             calls in one turn), function_call_output -> a tool message;
                             reasoning items are dropped (the templates re-render none)
  tools (flat function tools), tool_choice ({"type": "function", "name"})
                          -> chat's nested forms
  text.format             -> response_format (text, json_object, json_schema)
  max_output_tokens       -> max_completion_tokens; reasoning.effort -> reasoning_effort
  temperature, top_p, parallel_tool_calls, user, stream, and the chat extensions (top_k,
  min_p, repetition_penalty, stop, seed, ignore_eos, chat_template_kwargs,
  continue_final_message, ...) as they are.

  include ["message.output_text.logprobs"] / top_logprobs -> logprobs / top_logprobs (each
                          output_text part's logprobs, as chat's)

previous_response_id continues a stored response's conversation (responses_store.py: kept in
this server's memory, the newest ones); conversation and background are refused (400);
metadata is echoed back; truncation "disabled" / "auto" and the other include values are
accepted and change nothing.
"""
from __future__ import annotations

from typing import Any

from radixserve.server.errors import APIError

# Responses fields handled here (the rest of a body goes to the chat request as it is)
RESPONSES_FIELDS = frozenset({
    "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "reasoning",
    "store", "metadata", "truncation", "include", "previous_response_id", "conversation",
    "background", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
    "top_logprobs"})
# chat fields a Responses body may carry as extensions (vLLM's and SGLang's extra_body)
CHAT_EXTENSIONS = frozenset({
    "model", "temperature", "top_p", "stream", "user", "parallel_tool_calls", "seed", "stop",
    "frequency_penalty", "presence_penalty", "logit_bias", "top_k", "min_p",
    "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "stop_token_ids", "include_stop_str_in_output",
    "chat_template_kwargs", "separate_reasoning", "add_generation_prompt",
    "continue_final_message", "priority", "lora_path"})
REFUSED = {"conversation": "stored conversations are not kept",
           "background": "background responses are not supported"}


def _text_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content: a string or input_text / output_text parts as one string;
    with input_image parts, the chat route's parts (text and image_url)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of parts", param="input")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(f"{where}: an input_image part needs its image_url (file_id "
                               "is not supported)", param="input")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if kind not in ("input_text", "output_text", "text") or \
                not isinstance(part.get("text"), str):
            raise APIError(f"{where}: content parts of type {kind!r} are not supported; only "
                           "input_text, output_text and input_image", param="input")
        parts.append({"type": "text", "text": part["text"]})
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _instructions(body: dict[str, Any]) -> list[dict[str, Any]]:
    instructions = body.get("instructions")
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise APIError("instructions must be a string", param="instructions")
    return [{"role": "system", "content": instructions}]


def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat turns of a Responses body's `input` (not its instructions)."""
    messages: list[dict[str, Any]] = []
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError("input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(f"{where}.role must be user, assistant, system or developer",
                               param="input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], item.get("name"),
                                                    item.get("arguments"))):
                raise APIError(f"{where}: a function_call needs call_id, name and arguments "
                               "(strings)", param="input")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise APIError(f"{where}: a function_call_output needs its call_id",
                               param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(output, where)})
        elif kind != "reasoning":
            raise APIError(f"{where}: input items of type {kind!r} are not supported",
                           param="input")
    return messages


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError("tools must be a list", param="tools")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(f"tools of type {kind!r} are not supported; only function tools",
                           param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError("text.format.type must be text, json_object or json_schema",
                   param="text.format")


def _effort(reasoning: Any) -> Any:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise APIError("reasoning must be an object such as {\"effort\": \"low\"}",
                       param="reasoning")
    return reasoning.get("effort")


def chat_body(body: Any, history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat completion request (a raw body for ChatCompletionRequest) of a Responses
    body; `history`: the conversation of its previous_response_id, between the instructions
    (a previous response's are not carried over, as OpenAI's) and the input."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for name, why in REFUSED.items():
        if body.get(name):
            raise APIError(f"{name}: {why} by this server", param=name)
    unknown = sorted(set(body) - RESPONSES_FIELDS - CHAT_EXTENSIONS)
    if unknown:
        raise APIError(f"unsupported field {unknown[0]!r}", param=unknown[0])
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise APIError("truncation must be \"disabled\" or \"auto\"", param="truncation")
    chat = {k: v for k, v in body.items() if k in CHAT_EXTENSIONS}
    chat["messages"] = _instructions(body) + list(history or []) + input_messages(body)
    extra: dict[str, Any] = {
        "tools": _tools(body.get("tools")), "tool_choice": _tool_choice(body.get("tool_choice")),
        "response_format": _response_format(body.get("text")),
        "max_completion_tokens": body.get("max_output_tokens"),
        "reasoning_effort": _effort(body.get("reasoning"))}
    chat.update({k: v for k, v in extra.items() if v is not None})
    include = body.get("include") or []
    if not isinstance(include, list):
        raise APIError("include must be a list", param="include")
    if "message.output_text.logprobs" in include or body.get("top_logprobs"):
        chat["logprobs"] = True  # each output_text part's logprobs (and top_logprobs)
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


# chat parameter names -> the Responses names a caller sent them under (for errors)
RESPONSES_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                   "max_tokens": "max_output_tokens", "response_format": "text.format",
                   "reasoning_effort": "reasoning.effort"}


def renamed(exc: APIError) -> APIError:
    """A chat route's error about a request made from a Responses body, naming the Responses
    field (and saying so in its message)."""
    name = RESPONSES_NAMES.get(exc.param or "")
    if name is None:
        return exc
    message = exc.message.replace(exc.param or "", name)
    return APIError(message, exc.status_code, param=name, code=exc.code,
                    error_type=exc.error_type)
