"""The OpenAI-compatible API through the real `openai` SDK, against the real server."""
from __future__ import annotations

import math
from typing import Any

import pytest
import requests

from tests.server.conftest import API_KEY
from tests.server.native_client import post

PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colors."}]


def native_text(server: Any, text: str, max_new_tokens: int) -> dict:
    response = requests.post(server.url("/generate"), headers=server.headers, timeout=300,
                             json={"text": text, "sampling_params": {
                                 "max_new_tokens": max_new_tokens, "temperature": 0}})
    response.raise_for_status()
    return response.json()


def test_models(openai_client: Any, model_name: str) -> None:
    assert model_name == "SmolLM2-135M-Instruct"
    assert openai_client.models.retrieve(model_name).id == model_name


def test_completion_matches_native_generate(server: Any, openai_client: Any,
                                            model_name: str) -> None:
    completion = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12,
                                                  temperature=0)
    native = native_text(server, PROMPT, 12)
    choice = completion.choices[0]
    assert choice.text == native["text"]
    assert completion.usage.completion_tokens == native["meta_info"]["completion_tokens"]
    assert completion.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
    assert completion.usage.total_tokens == (completion.usage.prompt_tokens
                                             + completion.usage.completion_tokens)
    if choice.finish_reason == "length":
        assert completion.usage.completion_tokens == 12


def test_completion_stream_is_incremental_and_equal(openai_client: Any, model_name: str) -> None:
    full = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16,
                                            temperature=0, stop=None)
    stream = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    pieces, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            reasons.append(choice.finish_reason)
    assert len([p for p in pieces if p]) > 1, "tokens must arrive in several chunks"
    assert "".join(pieces) == full.choices[0].text
    assert reasons[-1] == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_chat_stream_equals_non_stream(openai_client: Any, model_name: str) -> None:
    full = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=20,
                                                 temperature=0)
    stream = openai_client.chat.completions.create(model=model_name, messages=CHAT,
                                                   max_completion_tokens=20, temperature=0,
                                                   stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]


def test_chat_uses_the_tokenizer_chat_template(server: Any, openai_client: Any,
                                               model_name: str, smollm_tokenizer: Any) -> None:
    chat = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8,
                                                 temperature=0)
    prompt = smollm_tokenizer.apply_chat_template(CHAT, tokenize=False,
                                                  add_generation_prompt=True)
    ids = smollm_tokenizer.encode(prompt, add_special_tokens=False)
    native = requests.post(server.url("/generate"), headers=server.headers, timeout=300, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == native["text"]


def test_chat_continues_a_partial_assistant_turn(server: Any, openai_client: Any,
                                                 model_name: str, smollm_tokenizer: Any) -> None:
    """vLLM's continue_final_message through the SDK's extra_body: the answer extends the
    last assistant turn, whose end-of-turn the template leaves out."""
    turns = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]
    chat = openai_client.chat.completions.create(
        model=model_name, messages=turns, max_tokens=6, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    prompt = smollm_tokenizer.apply_chat_template(turns, tokenize=False,
                                                  add_generation_prompt=False,
                                                  continue_final_message=True)
    ids = smollm_tokenizer.encode(prompt, add_special_tokens=False)
    native = requests.post(server.url("/generate"), headers=server.headers, timeout=300, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert prompt.endswith("The capital of France is")
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == native["text"]


def test_completion_logprobs_and_echo(openai_client: Any, model_name: str,
                                      smollm_tokenizer: Any) -> None:
    out = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6,
                                           temperature=0, logprobs=3, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    n_prompt = len(smollm_tokenizer.encode(PROMPT))
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == n_prompt + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for i in range(1, len(lp.tokens)):
        # the top 3, and the chosen token when it is not among them
        assert lp.token_logprobs[i] <= 0.0 and len(lp.top_logprobs[i]) <= 4
        assert lp.tokens[i] in lp.top_logprobs[i]
        assert max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i] - 1e-4
    # greedy: every generated token is the most likely one
    for i in range(n_prompt, len(lp.tokens)):
        assert math.isclose(lp.token_logprobs[i], max(lp.top_logprobs[i].values()),
                            abs_tol=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_0_lists_the_chosen_token(openai_client: Any, model_name: str,
                                                       stream: bool) -> None:
    """logprobs 0: each position's top_logprobs holds the chosen token alone, as vLLM's do
    (null came back)."""
    out = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4,
                                           temperature=0, logprobs=0, stream=stream)
    chunks = list(out) if stream else [out]
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    lps = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    tops = [x for c in chunks for x in c.choices[0].logprobs.top_logprobs]
    assert len(tops) == len(tokens) == 4
    assert tops == [{token: lp} for token, lp in zip(tokens, lps)]


def _token_bytes(name: str) -> bytes:
    if name.startswith("bytes:"):
        return bytes.fromhex(name[len("bytes:"):].replace("\\x", ""))
    return name.encode("utf-8")


def test_completion_logprobs_of_characters_split_over_tokens(openai_client: Any,
                                                             model_name: str,
                                                             smollm_tokenizer: Any) -> None:
    """An emoji is several byte-level tokens: each is named "bytes:\\xNN.." as OpenAI does
    (not U+FFFD), their bytes join into the text, and text_offset counts the characters
    before each token (a token inside a character points at it), never past the text."""
    prompt = "Party \U0001f389\U0001f382 time \u00e9t\u00e9"
    assert any("\ufffd" in smollm_tokenizer.decode([t]) for t in smollm_tokenizer.encode(prompt))
    out = openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=4,
                                           temperature=0, logprobs=2, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    assert not any("\ufffd" in t for t in lp.tokens)
    assert any(t.startswith("bytes:\\x") for t in lp.tokens)
    data = [_token_bytes(t) for t in lp.tokens]
    assert b"".join(data).decode("utf-8") == choice.text
    assert lp.text_offset == [len(b"".join(data[:i]).decode("utf-8", errors="ignore"))
                              for i in range(len(data))]
    assert max(lp.text_offset) <= len(choice.text)
    for tops in lp.top_logprobs[1:]:
        assert not any("\ufffd" in t for t in tops)


def test_chat_logprobs(openai_client: Any, model_name: str) -> None:
    out = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8,
                                                temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-4)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_n_samples(openai_client: Any, model_name: str) -> None:
    out = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8,
                                                temperature=1.0, n=2, seed=7)
    assert [c.index for c in out.choices] == [0, 1]
    assert 2 <= out.usage.completion_tokens <= 16
    again = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8,
                                                  temperature=1.0, n=2, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    comp = openai_client.completions.create(model=model_name, prompt=[PROMPT, "1, 2, 3,"],
                                            max_tokens=4, temperature=0, n=2)
    assert [c.index for c in comp.choices] == [0, 1, 2, 3]
    assert comp.choices[0].text == comp.choices[1].text  # greedy copies agree
    assert comp.choices[2].text == comp.choices[3].text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text(openai_client: Any, model_name: str, stream: bool) -> None:
    prompt = "1, 2, 3, 4,"
    free = openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=16,
                                            temperature=0).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    assert stop.strip(), f"pick a stop string from {free!r}"
    expected = free[:free.find(stop)]
    out = openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=16,
                                           temperature=0, stop=[stop], stream=stream)
    if stream:
        chunks = list(out)
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        text, reason = out.choices[0].text, out.choices[0].finish_reason
    assert text == expected
    assert reason == "stop"


def _completion_text(openai_client: Any, model_name: str, stream: bool,
                     **fields: Any) -> tuple[str, str]:
    out = openai_client.completions.create(model=model_name, prompt="1, 2, 3, 4,", max_tokens=16,
                                           temperature=0, stream=stream, extra_body=fields)
    if stream:
        chunks = list(out)
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    return out.choices[0].text, out.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_stop_tokens_and_include_stop_str_in_output(server: Any, openai_client: Any,
                                                    model_name: str, smollm_tokenizer: Any,
                                                    stream: bool) -> None:
    """A stop token's text is left out (it was returned), as vLLM leaves it out;
    include_stop_str_in_output keeps it, and keeps a matched stop string."""
    free = openai_client.completions.create(model=model_name, prompt="1, 2, 3, 4,",
                                            max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
    ids = post(server, "/generate", {"text": "1, 2, 3, 4,", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}).json()["output_ids"]
    assert smollm_tokenizer.decode(ids) == free.choices[0].text
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # its first occurrence
    stop_id = ids[at]
    before = smollm_tokenizer.decode(ids[:at])
    with_token = smollm_tokenizer.decode(ids[:at + 1])
    assert _completion_text(openai_client, model_name, stream,
                            stop_token_ids=[stop_id]) == (before, "stop")
    assert _completion_text(openai_client, model_name, stream, stop_token_ids=[stop_id],
                            include_stop_str_in_output=True) == (with_token, "stop")
    stop = with_token[len(before):].strip() or with_token[-2:]
    cut = with_token.find(stop)
    assert _completion_text(openai_client, model_name, stream, stop=[stop],
                            include_stop_str_in_output=True) == (with_token[:cut + len(stop)],
                                                                 "stop")


def test_token_id_prompts_and_max_tokens(openai_client: Any, model_name: str,
                                         smollm_tokenizer: Any) -> None:
    ids = smollm_tokenizer.encode(PROMPT)
    by_ids = openai_client.completions.create(model=model_name, prompt=ids, max_tokens=5,
                                              temperature=0, extra_body={"ignore_eos": True})
    by_text = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.completion_tokens == 5 and by_ids.choices[0].finish_reason == "length"


def test_api_key_is_required(server: Any) -> None:
    response = requests.get(server.url("/v1/models"), timeout=30)
    assert response.status_code == 401
    ok = requests.get(server.url("/v1/models"), timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


def test_bundled_model_default_sampling_gives_a_sensible_answer(openai_client: Any,
                                                                model_name: str) -> None:
    """No temperature in the request: the bundled model's documented default (greedy)."""
    answers = [openai_client.chat.completions.create(
        model=model_name, max_tokens=12,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    ).choices[0].message.content for _ in range(2)]
    assert answers[0] == answers[1] and "Paris" in answers[0]


def test_fields_current_clients_send_are_accepted(openai_client: Any, model_name: str) -> None:
    out = openai_client.chat.completions.create(
        model=model_name, max_tokens=3, temperature=0, store=False, metadata={"k": "v"},
        service_tier="auto", reasoning_effort="low",
        messages=[{"role": "user", "content": "Hi"}])
    assert out.choices[0].message.content


def test_sglang_generate_fields_pass_at_their_defaults(server: Any) -> None:
    import requests

    from tests.server.conftest import API_KEY
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "lora_path": None,
            "return_hidden_states": False, "custom_logit_processor": None, "log_metrics": True,
            "image_data": None, "modalities": []}
    assert requests.post(server.url("/generate"), json=body, headers=auth,
                         timeout=60).status_code == 200
    bad = requests.post(server.url("/generate"), json={**body, "lora_path": "my-adapter"},
                        headers=auth, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    unknown = requests.post(server.url("/generate"), json={**body, "frobnicate": 1},
                            headers=auth, timeout=60)
    assert unknown.status_code == 400


def test_logit_bias_forces_and_bans_tokens(server: Any, openai_client: Any, model_name: str,
                                           smollm_tokenizer: Any) -> None:
    import requests

    from tests.server.conftest import API_KEY
    token = smollm_tokenizer.encode(" Paris", add_special_tokens=False)[0]
    out = openai_client.completions.create(model=model_name, prompt="The capital of France is",
                                           max_tokens=3, temperature=0,
                                           logit_bias={str(token): 100})
    assert out.choices[0].text == smollm_tokenizer.decode([token] * 3)
    native = requests.post(server.url("/generate"), timeout=60,
                           headers={"Authorization": f"Bearer {API_KEY}"},
                           json={"text": "The capital of France is", "sampling_params": {
                               "max_new_tokens": 4, "temperature": 0,
                               "logit_bias": {str(token): -100}}}).json()
    assert token not in native["output_ids"]


def _post(server: Any, path: str, body: dict) -> requests.Response:
    return requests.post(server.url(path), headers=server.headers, timeout=120, json=body)


def test_tokenize_and_detokenize_as_vllm(server: Any, openai_client: Any, model_name: str,
                                         smollm_tokenizer: Any) -> None:
    """vLLM's /tokenize (a prompt, or chat messages through the template exactly as the chat
    route renders them) and /detokenize round trip."""
    plain = _post(server, "/tokenize", {"model": model_name, "prompt": PROMPT,
                                         "return_token_strs": True}).json()
    ids = smollm_tokenizer.encode(PROMPT)
    max_len = requests.get(server.url("/v1/models"), headers=server.headers,
                           timeout=30).json()["data"][0]["max_model_len"]
    assert plain == {"count": len(ids), "max_model_len": max_len, "tokens": ids,
                     "token_strs": smollm_tokenizer.convert_ids_to_tokens(ids)}
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {
        "prompt": smollm_tokenizer.decode(ids)}

    chat_ids = _post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    usage = openai_client.chat.completions.create(model=model_name, messages=CHAT,
                                                  max_tokens=1).usage
    assert chat_ids == smollm_tokenizer.encode(smollm_tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert usage.prompt_tokens == len(chat_ids)
    closed = _post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert chat_ids[:closed.json()["count"]] == closed.json()["tokens"]
    assert closed.json()["count"] < len(chat_ids)
    assert requests.get(server.url("/version"), headers=server.headers,
                        timeout=30).json()["version"]
    # tool_choice "none" renders tools only through a template that renders them (vLLM's
    # rule); SmolLM2's does not, so no system prompt of tools: the plain conversation, where
    # "auto" gets that prompt
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_none = _post(server, "/tokenize", {"messages": CHAT, "tools": tools,
                                            "tool_choice": "none"}).json()["tokens"]
    with_auto = _post(server, "/tokenize", {"messages": CHAT, "tools": tools}).json()["tokens"]
    assert with_none == chat_ids and len(with_auto) > len(chat_ids)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                   "continue_final_message": True}, "continue_final_message"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_refuses_bad_bodies(server: Any, path: str, body: dict, param: str) -> None:
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tokenize_names_the_served_model(server: Any) -> None:
    assert _post(server, "/tokenize", {"model": "gpt-17", "prompt": "a"}).status_code == 404
    assert _post(server, "/detokenize", {"model": "gpt-17", "tokens": [1]}).status_code == 404


# a grammar that makes the bundled (non-thinking) model write a Qwen3-style thinking block
THINKING = {"regex": "<think>[a-z ]{2,12}</think>\n?[A-Z][a-z ]{2,12}"}


def test_reasoning_is_split_from_the_answer(openai_client: Any, model_name: str) -> None:
    """--reasoning-parser qwen3 on the shared server: an assistant turn continued after
    "<think>" leaves the block open, so the output is reasoning_content (content null),
    streamed or not; separate_reasoning false gives it as content. A grammar whose tags are
    not single tokens (the bundled tokenizer's) constrains from the first token, so such an
    output is all answer even where it writes a block."""
    turns = CHAT + [{"role": "assistant", "content": "<think>\nThe user asks about"}]
    args = {"model": model_name, "messages": turns, "max_tokens": 8, "temperature": 0}
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    # once first, so each request below takes its prompt from the radix cache alike (a cold
    # prefill's rounding can differ from a cached prefix's and flip a greedy token)
    openai_client.chat.completions.create(**args, extra_body=cont)
    raw = openai_client.chat.completions.create(
        **args, extra_body={**cont, "separate_reasoning": False}).choices[0].message
    assert raw.content and getattr(raw, "reasoning_content", None) is None

    split = openai_client.chat.completions.create(**args, extra_body=cont).choices[0].message
    assert split.reasoning_content == raw.content.strip() and split.content is None

    thought, content = "", ""
    for chunk in openai_client.chat.completions.create(**args, extra_body=cont, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (thought, content) == (split.reasoning_content, "")

    constrained = openai_client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=60, temperature=0,
        extra_body=THINKING).choices[0].message
    assert constrained.content.startswith("<think>")
    # the field is there, null, as in every answer of a server that separates reasoning
    assert "reasoning_content" in constrained.model_extra
    assert constrained.model_extra["reasoning_content"] is None


def test_vllm_ranges_of_top_k_and_repetition_penalty(openai_client: Any, model_name: str) -> None:
    """top_k 0 means all tokens, as -1 does (vLLM); repetition_penalty takes any value > 0
    (vLLM's bound; SGLang v0.2 capped it at 2)."""
    def text(**fields: Any) -> str:
        return openai_client.completions.create(
            model=model_name, prompt="The cat sat on the", max_tokens=8, temperature=0.8,
            seed=7, extra_body=fields).choices[0].text

    assert text(top_k=0) == text(top_k=-1)
    assert text(repetition_penalty=2.5) != text(repetition_penalty=1.0)
