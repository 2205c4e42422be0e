"""add_generation_prompt, continue_final_message and chat_template_kwargs on the chat route:
the prompt the bundled tokenizer's template renders with them (openai_chat.render_prompt)."""
from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest

from radixserve.server.errors import APIError
from radixserve.server.openai_chat import render_prompt
from radixserve.server.openai_common import OpenAIContext
from radixserve.server.openai_protocol import ChatCompletionRequest, parse_model

TURNS = [{"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "The colour is"}]


def _render(tokenizer: Any, **fields: Any) -> tuple[str, list[int]]:
    body = parse_model(ChatCompletionRequest, {"messages": TURNS[:1], **fields})
    body.check_unsupported()
    ctx = OpenAIContext(tokenizer_manager=SimpleNamespace(tokenizer=tokenizer),  # type: ignore
                        model_name="m", model_aliases=frozenset({"m"}))
    prompt, ids, _ = render_prompt(ctx, body)
    return prompt, ids


def _with_template(tokenizer: Any, template: str) -> Any:
    """A shallow copy of the tokenizer with its own chat template."""
    other = copy.copy(tokenizer)
    other.chat_template = template
    return other


def test_generation_prompt_is_on_by_default_and_can_be_left_off(smollm_tokenizer: Any) -> None:
    opened, ids = _render(smollm_tokenizer)
    closed, _ = _render(smollm_tokenizer, add_generation_prompt=False)
    assert opened == smollm_tokenizer.apply_chat_template(TURNS[:1], tokenize=False,
                                                          add_generation_prompt=True)
    assert opened.startswith(closed) and opened.rstrip().endswith("assistant")
    assert not closed.rstrip().endswith("assistant")
    assert ids == smollm_tokenizer.encode(opened, add_special_tokens=False)


def test_continue_final_message_leaves_the_last_turn_open(smollm_tokenizer: Any) -> None:
    prompt, _ = _render(smollm_tokenizer, messages=TURNS, add_generation_prompt=False,
                        continue_final_message=True)
    assert prompt.endswith("The colour is")  # no end-of-turn after the partial answer
    assert prompt == smollm_tokenizer.apply_chat_template(
        TURNS, tokenize=False, add_generation_prompt=False, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template(smollm_tokenizer: Any) -> None:
    tokenizer = _with_template(
        smollm_tokenizer, "{% for m in messages %}{{ m['content'] }}{% endfor %}"
                          "{% if enable_thinking is defined and not enable_thinking %} /no_think"
                          "{% endif %}")
    plain, _ = _render(tokenizer)
    quiet, _ = _render(tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert plain == "Name a colour." and quiet == "Name a colour. /no_think"


def test_a_template_that_refuses_the_kwargs_is_a_400(smollm_tokenizer: Any) -> None:
    tokenizer = _with_template(smollm_tokenizer, "{{ raise_exception('no ' + mode) }}")
    with pytest.raises(APIError) as info:
        _render(tokenizer, chat_template_kwargs={"mode": "thinking"})
    assert info.value.status_code == 400 and "no thinking" in str(info.value)


def test_reasoning_effort_reaches_the_template(smollm_tokenizer: Any) -> None:
    """gpt-oss's template writes `Reasoning: <effort>` into its system message."""
    tokenizer = _with_template(
        smollm_tokenizer, "Reasoning: {{ reasoning_effort | default('medium') }}|"
                          "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert _render(tokenizer)[0] == "Reasoning: medium|Name a colour."
    assert _render(tokenizer, reasoning_effort="high")[0] == "Reasoning: high|Name a colour."
    # chat_template_kwargs say last
    assert _render(tokenizer, reasoning_effort="high",
                   chat_template_kwargs={"reasoning_effort": "low"})[0].startswith(
        "Reasoning: low|")
