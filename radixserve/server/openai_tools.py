"""Tool calling on /v1/chat/completions: checking `tools` and `tool_choice`, rendering a
conversation with tool turns through the chat template, forcing a call with a grammar, and
turning the model's text back into `message.tool_calls`.

- tool_choice "auto" (the default with tools): the template renders the tools and the output is
  parsed for calls in the parser's format (server/tool_parsers/); "none": the tools rendered
  by a template that renders tools (as vLLM does: the model still knows them; a template
  without them gets no system prompt of tools) but no parsing, or with
  --exclude-tools-when-tool-choice-none not rendered either (SGLang's behaviour); "required":
  the output is constrained (xgrammar EBNF) to calls of the tools, so it always parses and the
  arguments validate against the tool's parameters schema: one or more calls when
  parallel_tool_calls is true or absent (OpenAI's default) and the format can hold several in
  one answer (hermes, mistral, deepseek; llama3's is one call per message), exactly one when
  it is false; {"type": "function", "function": {"name": ...}}: exactly one call of that tool.
  parallel_tool_calls false also keeps only the first call an "auto" answer makes.
- Templates that render tools themselves (they mention `tools`) get them through
  apply_chat_template(tools=...); others get a system prompt listing them in the parser's
  format. Assistant turns with tool_calls go to templates that know `tool_calls` as they are
  (arguments as objects, or as the JSON text where the template concatenates them with `+`,
  as DeepSeek's do); others get the calls written as text in the parser's format.
- The parser's markers may be special tokens of the tokenizer (Mistral's [TOOL_CALLS], Llama
  3.1's <|python_tag|>, DeepSeek's five tool markers), which skip_special_tokens would strip
  from the text: such requests keep those special tokens (`special_markers`,
  SamplingParams.keep_special_tokens; vLLM turns skip_special_tokens off instead, which would
  also let EOS and other control tokens into the content).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.errors import APIError
from radixserve.server.openai_protocol import ChatCompletionRequest, ImageRendering
from radixserve.server.tokenizer_utils import special_token_ids
from radixserve.server.tool_parsers.base import ToolCall, ToolCallParser
from radixserve.server.tool_parsers.grammar import forced_call_ebnf
from radixserve.server.tool_parsers.registry import get_parser
from radixserve.server.tool_parsers.streaming import new_call_id

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# a template that concatenates a call's arguments with `+` (no filter between), as DeepSeek's
# `... + tool['function']['arguments'] + ...`: it needs them as the JSON text
_ARGUMENTS = r"""(?:\.arguments\b|\[\s*['"]arguments['"]\s*\])"""
_ARGUMENTS_CONCATENATED = re.compile(rf"\+\s*[\w.]+(?:\[\s*['\"]\w+['\"]\s*\])*{_ARGUMENTS}"
                                     rf"(?!\s*\|)|{_ARGUMENTS}\s*\+")


@dataclass
class ToolPlan:
    parser: ToolCallParser  # formats history calls; parses output when `parse_output`
    tools: list[dict[str, Any]] = field(default_factory=list)  # rendered for the model
    parse_output: bool = False
    forced_ebnf: str | None = None  # the grammar of a required / named call
    max_calls: int | None = None  # 1 with parallel_tool_calls false: later calls are dropped


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """OpenAI tool dicts, checked: {"type": "function", "function": {"name", "description"?,
    "parameters"?: a JSON schema object}}."""
    checked: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(function, dict):
            raise APIError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                           "{...}}", param=f"tools.{i}")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise APIError(f"tools[{i}].function.name must be 1-64 letters, digits, _, . or "
                           f"-, got {name!r}", param=f"tools.{i}.function.name")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools.{i}.function.parameters")
        checked.append(tool)
    return checked


def plan_tools(body: ChatCompletionRequest, parser_name: str | None,
               chat_template: str | None, exclude_tools_when_none: bool = False) -> ToolPlan:
    tools = check_tools(body.tools)
    parser = get_parser(parser_name, chat_template, tools)
    choice = body.tool_choice
    if choice == "none":
        # no call parsed; the tools stay visible where the template renders them (vLLM's
        # rule), unless the server says not. Not in the system prompt a template without
        # tools gets: it tells the model how to call them, and nothing would parse the call
        rendered = "tools" in (chat_template or "") and not exclude_tools_when_none
        return ToolPlan(parser, tools if rendered else [])
    if choice in (None, "auto") and not tools:
        return ToolPlan(parser)
    max_calls = 1 if body.parallel_tool_calls is False else None
    if choice in (None, "auto"):
        return ToolPlan(parser, tools, parse_output=True, max_calls=max_calls)
    if not tools:
        raise APIError("tool_choice needs tools", param="tool_choice")
    parallel = False
    if choice == "required":
        forced, parallel = tools, max_calls is None
    elif isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        forced = [t for t in tools if t["function"]["name"] == name]
        if not forced:
            raise APIError(f"tool_choice names function {name!r}, which is not in tools",
                           param="tool_choice")
    else:
        raise APIError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": "
                       "\"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    if body.grammar():
        raise APIError("a required or named tool_choice cannot be combined with "
                       "response_format, regex, ebnf or a guided_* field", param="tool_choice")
    try:
        ebnf = forced_call_ebnf(parser, forced, parallel)
    except Exception as exc:  # noqa: BLE001 - xgrammar's error about the tool's schema
        raise APIError(f"invalid tool parameters schema: {exc}", param="tools") from exc
    return ToolPlan(parser, tools, parse_output=True, forced_ebnf=ebnf, max_calls=max_calls)


def kept_special_tokens(plan: ToolPlan, tokenizer: Any) -> tuple[str, ...]:
    """The special tokens a request's output text must keep: the parser's markers that are
    special tokens of `tokenizer` when the output is parsed for calls (decoding with
    skip_special_tokens would drop them, and the calls with them)."""
    if not plan.parse_output or not plan.parser.special_markers:
        return ()
    specials = special_token_ids(tokenizer)
    return tuple(m for m in plan.parser.special_markers if m in specials)


def render_conversation(body: ChatCompletionRequest, plan: ToolPlan, chat_template: str,
                        images: ImageRendering | None = None) -> list[dict[str, Any]]:
    """The messages for apply_chat_template, adapted to what the template knows (`images`:
    how it gets the images; None: they are refused)."""
    messages = body.conversation(images)
    knows_calls = "tool_calls" in chat_template
    arguments_as_text = _ARGUMENTS_CONCATENATED.search(chat_template) is not None
    for i, message in enumerate(messages):
        calls = message.pop("tool_calls", None)
        if not calls:
            continue
        parsed = [_history_call(call, f"messages.{i}.tool_calls.{j}")
                  for j, call in enumerate(calls)]
        if knows_calls:
            message["tool_calls"] = [
                {"id": call.get("id") or new_call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments if arguments_as_text
                              else json.loads(c.arguments)}}
                for call, c in zip(calls, parsed)]
        else:
            _append_text(message, plan.parser.format_calls(parsed), "\n")
    if plan.tools and "tools" not in chat_template:
        prompt = plan.parser.system_prompt(plan.tools)
        if messages and messages[0]["role"] == "system":
            _append_text(messages[0], prompt, "\n\n")
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def _append_text(message: dict[str, Any], text: str, separator: str) -> None:
    """Text added after a message's content (a string, or a list of parts)."""
    content = message["content"]
    if isinstance(content, list):
        content.append({"type": "text", "text": separator + text if content else text})
    else:
        message["content"] = f"{content}{separator}{text}" if content else text


def _history_call(call: Any, param: str) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError("a tool call needs function.name and function.arguments", param=param)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            raise APIError("function.arguments must be a JSON text", param=param) from None
        except RecursionError:  # as the body itself (http_utils.parse_json)
            raise APIError("function.arguments is nested too deeply", param=param) from None
    else:
        arguments = json.dumps(arguments)
    return ToolCall(function["name"], arguments)


def tool_message(plan: ToolPlan, text: str, cut: bool = False) -> tuple[dict[str, Any], bool]:
    """The assistant message of a finished output, and whether it called tools; `cut`: max_tokens
    ended it, so a call it was writing is kept unfinished, as a stream of it sent it."""
    if not plan.parse_output:
        return {"role": "assistant", "content": text}, False
    content, calls = plan.parser.parse(text, keep_unfinished=cut)
    if not calls:  # parse's content: the text, less a call begun and left unfinished
        return {"role": "assistant", "content": content}, False
    calls = calls[:plan.max_calls]
    return {"role": "assistant", "content": content or None,
            "tool_calls": [{"id": new_call_id(), "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}, True
