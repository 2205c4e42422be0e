"""Pydantic models of the OpenAI-compatible API (requests), and their mapping to SamplingParams.

Policy for fields (never silently wrong):
- OpenAI fields we implement: model, prompt/messages, max_tokens, max_completion_tokens, n,
  temperature, top_p, stop, stream, stream_options.include_usage, seed, frequency_penalty,
  presence_penalty, logit_bias, echo, logprobs, top_logprobs, best_of (== n only), user
  (accepted, unused), response_format (text, json_object, json_schema: constrained decoding,
  on completions too), tools, tool_choice and parallel_tool_calls (openai_tools.py).
- Fields current clients send that do not change the output (store, metadata, service_tier,
  prediction, modalities): accepted and ignored (logged once at DEBUG). reasoning_effort
  (OpenAI's none, minimal, low, medium, high; anything else is a 400): low, medium and high
  go to the chat template, which gpt-oss's reads (others ignore it).
- Extensions (vLLM/SGLang style, send them with the SDK's extra_body): priority, lora_path
  (SGLang's way to name a LoRA adapter; `model` names one too, as vLLM), top_k, min_p,
  repetition_penalty, min_tokens, ignore_eos, skip_special_tokens,
  spaces_between_special_tokens, stop_token_ids, include_stop_str_in_output (vLLM's: keep
  the matched stop string or stop token's text), regex, ebnf (constrained decoding; also by
  vLLM's names guided_json, guided_regex, guided_choice, guided_grammar); on chat
  also add_generation_prompt, continue_final_message and chat_template_kwargs (variables for
  the chat template, e.g. Qwen3's enable_thinking), and SGLang's separate_reasoning.
- OpenAI fields we do not implement (suffix, functions, function_call, ...) are rejected with
  400 when given a non-empty value; any other unknown field is rejected with 400 naming it.
  Types are strict: "5" is not an integer.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      model_validator)
from pydantic import ValidationError

from radixserve.core.sampling_params import MAX_N, SamplingParams
from radixserve.server.errors import APIError

Number = Union[StrictFloat, StrictInt]


logger = logging.getLogger(__name__)
IGNORED_OPENAI_FIELDS = ("store", "metadata", "service_tier", "prediction", "modalities")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
TEMPLATE_EFFORTS = ("low", "medium", "high")  # what gpt-oss's template knows
_logged_ignored: set[str] = set()  # which ignored fields were already logged (once each)


def _log_ignored_once(names: list[str]) -> None:
    new = [n for n in names if n not in _logged_ignored]
    if new:
        _logged_ignored.update(new)
        logger.debug("accepted and ignored request field(s) %s (they do not change the output)",
                     ", ".join(new))


# sampling parameters by the names the OpenAI routes take them under, for error messages
OPENAI_FIELD_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
# apply_chat_template's own arguments: chat_template_kwargs reach the template's variables only
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """A field sent as null takes its default, as OpenAI's API documents ("n": integer
        or null, default 1) and vLLM accepts: the openai client sends null for an option the
        caller passed as None."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required()}


class StreamOptions(StrictModel):
    include_usage: StrictBool = False


class SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: StrictStr | None = None
    n: StrictInt = 1
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    # extensions
    priority: StrictInt | None = None  # vLLM's, with --enable-priority-scheduling
    lora_path: StrictStr | None = None  # SGLang's: a LoRA adapter by name (or `model`)
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    regex: StrictStr | None = None
    ebnf: StrictStr | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's guided decoding fields (extra_body), the same grammars by other names
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    # fields current clients send that do not change the output: accepted and ignored
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    prediction: Any = None
    modalities: Any = None
    reasoning_effort: Any = None

    def check_unsupported(self) -> None:
        """Raise APIError(400) for unsupported fields or values pydantic cannot express."""
        ignored = [n for n in IGNORED_OPENAI_FIELDS if getattr(self, n) is not None]
        if ignored:
            _log_ignored_once(ignored)
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise APIError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                           param="reasoning_effort")
        if not 1 <= self.n <= MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true",
                           param="stream_options")
        self.grammar()  # a bad response_format is refused before anything else is done

    def grammar_sources(self) -> list[tuple[str, str, str]]:
        """(request field, sampling parameter, grammar) for each constrained-decoding field
        given: response_format json_object / json_schema, the regex / ebnf extensions and
        vLLM's guided_json / guided_regex / guided_choice (an EBNF of the choices) /
        guided_grammar (EBNF). "" is given too: SamplingParams refuses it, as /generate."""
        sources = [(name, kind, value) for name, kind, value in (
            ("regex", "regex", self.regex), ("ebnf", "ebnf", self.ebnf),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_grammar", "ebnf", self.guided_grammar)) if value is not None]
        schema = response_format_schema(self.response_format)
        if schema is not None:
            sources.append(("response_format", "json_schema", schema))
        if self.guided_json is not None:
            sources.append(("guided_json", "json_schema", self.guided_json
                            if isinstance(self.guided_json, str) else json.dumps(self.guided_json)))
        if self.guided_choice is not None:
            sources.append(("guided_choice", "ebnf", choice_ebnf(self.guided_choice)))
        return sources

    def grammar(self) -> dict[str, str]:
        """The constrained-decoding sampling parameter this request asks for ({} if none);
        at most one field may give one."""
        sources = self.grammar_sources()
        if len(sources) > 1:
            raise APIError(f"give at most one of response_format, regex, ebnf and the guided_* "
                           f"fields, got {', '.join(name for name, _, _ in sources)}",
                           param=sources[1][0])
        return {kind: text for _, kind, text in sources}

    def grammar_field(self) -> str | None:
        """The request field the grammar came from (errors about it name this field)."""
        sources = self.grammar_sources()
        return sources[0][0] if sources else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_new_tokens: int,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The SamplingParams of one sample (n is expanded by the caller); fields the request
        leaves unset take `defaults` (the model's generation config), then SamplingParams'."""
        values: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens if self.min_tokens is not None else 0,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "seed": self.seed, "logit_bias": self.logit_bias or None,
            **self.grammar(),
        }
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "min_p": self.min_p, "frequency_penalty": self.frequency_penalty,
                    "presence_penalty": self.presence_penalty,
                    "repetition_penalty": self.repetition_penalty}
        values.update(defaults or {})
        values.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParams(**values)


PromptType = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """A PromptType value as a list of prompts (strings or token id lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


class CompletionRequest(SamplingFields):
    prompt: PromptType
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of is only supported when equal to n", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise APIError(f"logprobs must be in [0, 20], got {self.logprobs}", param="logprobs")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError("prompt must not be empty", param="prompt")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (strings or token id lists)."""
        return prompt_list(self.prompt)


@dataclass(frozen=True)
class ImageRendering:
    """How a chat template gets a conversation's images: every message's content as a list
    of parts ({"type": "image"} for an image) where the template reads parts, else text with
    `marker` where an image goes."""
    marker: str
    as_parts: bool

    @classmethod
    def for_template(cls, template: str, marker: str) -> "ImageRendering":
        """Parts where the template iterates over a message's content (`for x in
        message['content']`, `message.content | selectattr('type', ...)`), else text."""
        return cls(marker, _ITERATES_CONTENT.search(template) is not None)


_ITERATES_CONTENT = re.compile(
    r"""in\s+\w+(\[['"]content['"]\]|\.content)|content['"]?\]?\s*\|\s*selectattr""")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns that called tools
    tool_call_id: StrictStr | None = None  # tool turns: the call answered
    # an assistant message as this server returns it, sent back in the history: its
    # reasoning goes to the template (GLM's and gpt-oss's render it before a tool call);
    # OpenAI's message fields the SDK's model_dump() carries are accepted when null
    reasoning_content: StrictStr | None = None
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    def text(self, image_marker: str | None = None) -> str:
        """The content as one text; image parts become `image_marker` (None: refused)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type == "image_url" and image_marker is not None:
                parts.append(image_marker)
            else:
                parts.append(_part_text(part))
        return "".join(parts)

    def content_parts(self) -> list[dict[str, Any]]:
        """The content as the parts multimodal chat templates iterate over: text parts, and
        {"type": "image"} where an image goes."""
        if not isinstance(self.content, list):
            return [{"type": "text", "text": self.content or ""}]
        return [{"type": "image"} if part.type == "image_url" else
                {"type": "text", "text": _part_text(part)} for part in self.content]

    def image_sources(self) -> list[Any]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        sources = []
        for part in self.content:
            if part.type != "image_url":
                continue
            image = getattr(part, "image_url", None)
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url:
                raise APIError("an image_url part needs image_url.url", param="messages")
            sources.append(url)
        return sources


def _part_text(part: ContentPart) -> str:
    if part.type == "image_url":
        raise APIError("this model reads no images (a content part of type 'image_url')",
                       param="messages")
    if part.type != "text":
        raise APIError(f"content parts of type {part.type!r} are not supported; only text "
                       "and image_url", param="messages")
    if part.text is None:
        raise APIError("a content part of type 'text' needs its text", param="messages")
    return part.text


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's: with --reasoning-parser, false returns the reasoning inside content
    separate_reasoning: StrictBool = True

    def check_unsupported(self) -> None:
        super().check_unsupported()
        self.check_template_fields()
        for name in ("functions", "function_call"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported; use tools", param=name)
        choice = self.tool_choice
        if choice not in (None, "none", "auto", "required") and not (
                isinstance(choice, dict) and choice.get("type") == "function"
                and isinstance(choice.get("function"), dict)):
            raise APIError("tool_choice must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                           param="tool_choice")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= 20:
                raise APIError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}",
                               param="top_logprobs")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise APIError("max_tokens and max_completion_tokens differ; give one",
                           param="max_completion_tokens")
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:  # a chat answer has a token (vLLM, OpenAI)
                raise APIError(f"{name} must be at least 1, got {value}", param=name)

    def check_template_fields(self) -> None:
        """continue_final_message extends the last assistant turn instead of opening a new
        one, so it excludes the generation prompt; chat_template_kwargs may not set what the
        server passes itself."""
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise APIError("continue_final_message needs add_generation_prompt to be false",
                               param="continue_final_message")
            if self.messages[-1].role != "assistant":
                raise APIError("continue_final_message needs the last message to be the "
                               "assistant's", param="messages")
        clash = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if clash:
            raise APIError(f"chat_template_kwargs may not set {', '.join(clash)}; the server "
                           "sets them (use the request's own fields)",
                           param="chat_template_kwargs")

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for tokenizer.apply_chat_template beyond messages and tools."""
        effort = {"reasoning_effort": self.reasoning_effort} \
            if self.reasoning_effort in TEMPLATE_EFFORTS else {}  # gpt-oss's template reads it
        return {**effort, **(self.chat_template_kwargs or {}),
                "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def image_sources(self) -> list[Any]:
        """Every image of the conversation, in order."""
        return [url for m in self.messages for url in m.image_sources()]

    def conversation(self, images: ImageRendering | None = None) -> list[dict[str, Any]]:
        """Messages for tokenizer.apply_chat_template ("developer" is sent as "system"); tool
        turns keep their tool_call_id, assistant turns their tool_calls and reasoning. Image
        parts are refused without `images`, else rendered as it says."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            content: Any = m.content_parts() if images is not None and images.as_parts \
                else m.text(None if images is None else images.marker)
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                       "content": content}
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                message["tool_calls"] = m.tool_calls
            if m.reasoning_content is not None:  # vLLM's name
                message["reasoning_content"] = m.reasoning_content
                if not (message["content"] and m.tool_calls):
                    # gpt-oss's template reads `thinking`, and refuses it beside both content
                    # and tool calls
                    message["thinking"] = m.reasoning_content
            out.append(message)
        return out


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF whose only sentences are the choices (vLLM's guided_choice)."""
    if not choices:
        raise APIError("guided_choice needs at least one choice", param="guided_choice")
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def response_format_schema(response_format: dict[str, Any] | None) -> str | None:
    """The JSON schema (text) a response_format asks for, None for plain text."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object", "additionalProperties": True})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError("response_format json_schema needs json_schema.schema, a JSON "
                           "schema object", param="response_format")
        return json.dumps(schema)
    raise APIError(f"response_format type must be text, json_object or json_schema, got "
                   f"{kind!r}", param="response_format")


def parse_model(model_type: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; the first problem becomes a 400 in OpenAI's error shape."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model_type.model_validate(body)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc) from None


def validation_error_to_api_error(exc: ValidationError) -> APIError:
    error = exc.errors()[0]
    loc = [p for p in error["loc"] if isinstance(p, int) or not _is_type_tag(p)]
    param = ".".join(str(p) for p in loc) or None
    if error["type"] == "extra_forbidden":
        return APIError(f"unsupported field {param!r}", param=param)
    if error["type"] == "missing":
        return APIError(f"missing required field {param!r}", param=param)
    return APIError(f"invalid value for {param!r}: {error['msg']}", param=param)


def _is_type_tag(part: Any) -> bool:
    # pydantic names the union branch it tried in loc ("str", "list[int]", "function-after")
    return isinstance(part, str) and (part in ("str", "int", "float", "bool")
                                      or "[" in part or "-" in part)
