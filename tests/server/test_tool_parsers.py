"""Tool-call parsers on canned model texts (each format, finished and streamed in chunks of
every size), parser detection from chat templates, the forced-call grammar accepting what the
parser reads (one call, or several with parallel_tool_calls where the format holds them), and
history rendering through the bundled model's chat template."""
from __future__ import annotations

import json

import pytest

from radixserve.server.openai_protocol import ChatCompletionRequest
from radixserve.server.openai_tools import plan_tools, render_conversation, tool_message
from radixserve.server.tool_parsers.base import ToolCall
from radixserve.server.tool_parsers.deepseek import (CALL_BEGIN, CALL_END, CALLS_BEGIN,
                                                     CALLS_END, SEP)
from radixserve.server.tool_parsers.grammar import forced_call_ebnf
from radixserve.server.tool_parsers.registry import detect_parser_name, get_parser
from radixserve.server.tool_parsers.streaming import ToolCallStream

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}

# (parser, text, expected content, expected [(name, arguments object)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Paris", "unit": "c"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}b", "unit": "f"}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
               '\n</tool_call>',
     "", [("get_weather", {"city": "a}b", "unit": "f"}), ("get_time", {"zone": "UTC"})]),
    ("qwen25", "No tools needed: 4.", "No tools needed: 4.", []),
    # the marker without a call after it: all of it is content
    ("hermes", "Hi <tool_call> not json at all", "Hi <tool_call> not json at all", []),
    # the arguments before the name, with a "name" of their own
    ("hermes", '<tool_call>\n{"arguments": {"name": "Bob", "city": "Rome"}, "name": '
               '"get_weather"}\n</tool_call>', "",
     [("get_weather", {"name": "Bob", "city": "Rome"})]),
    ("llama3", '{"name": "get_time", "parameters": {"zone": "CET"}}', "",
     [("get_time", {"zone": "CET"})]),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
               '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}', "",
     [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome", "unit": "c"})]),
    ("llama3", "The answer is {not a call}.", "The answer is {not a call}.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", '
                '"unit": "c"}}, {"name": "get_time", "arguments": {"zone": "Z"}}]', "",
     [("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {"zone": "Z"})]),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "get_time", "arguments": "{\\"zone\\": \\"Z\\"}"}]',
     "Sure", [("get_time", {"zone": "Z"})]),
    # DeepSeek V3 / R1: content before; calls separated by a newline (as the template writes
    # them), nested braces and strings holding the markers' characters and a whole marker
    ("deepseek_v3", f'Let me check.\n{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n'
                    f'{{"city": "a}}b```｜{CALL_END}", "unit": "c", "n": {{"x": [{{"y": "}}"}}]}}}}'
                    f'\n```{CALL_END}\n{CALL_BEGIN}function{SEP}get_time\n```json\n{{"zone": '
                    f'"UTC"}}\n```{CALL_END}{CALLS_END}',
     "Let me check.", [("get_weather", {"city": f"a}}b```｜{CALL_END}", "unit": "c",
                                        "n": {"x": [{"y": "}"}]}}), ("get_time", {"zone": "UTC"})]),
    # read loosely: blanks around the markers, no "json" after the fence, no section end
    ("deepseek_v3", f'{CALLS_BEGIN}\n{CALL_BEGIN}function{SEP} get_time \n```\n{{"zone": "Z"}}\n'
                    f'```\n{CALL_END}', "", [("get_time", {"zone": "Z"})]),
    ("deepseek_v3", "A plain answer with ``` and { braces }.",
     "A plain answer with ``` and { braces }.", []),
    # a section that holds no call: all of it is content
    ("deepseek_v3", f"Hi {CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time{CALL_END}{CALLS_END}",
     f"Hi {CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time{CALL_END}{CALLS_END}", []),
    # DeepSeek V3.1: the name before the sep, the arguments' JSON right after it
    ("deepseek_v31", f'Checking {{both}}.{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": '
                     f'"{SEP}{{x}}", "unit": "f"}}{CALL_END}{CALL_BEGIN}get_time{SEP}{{"zone": '
                     f'"CET"}}{CALL_END}{CALLS_END}',
     "Checking {both}.", [("get_weather", {"city": f"{SEP}{{x}}", "unit": "f"}),
                          ("get_time", {"zone": "CET"})]),
    ("deepseekv31", f"{CALLS_BEGIN}{CALL_BEGIN}get_time{SEP}{{}}{CALL_END}{CALLS_END}", "",
     [("get_time", {})]),
    ("deepseekv31", "No tools: {}.", "No tools: {}.", []),
    # GLM-4.5: key / value pairs, a newline after the name and each pair; a string value
    # holding a tag-like text; without the request's tools a value is JSON where it parses
    ("glm45", "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a<b>"
              "c</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>\n"
              "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n"
              "</tool_call>",
     "Let me check.", [("get_weather", {"city": "a<b>c", "unit": "c"}),
                       ("get_time", {"zone": "UTC"})]),
    # GLM-4.7: no newlines; a JSON value, a call without arguments
    ("glm47", '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>'
              '<arg_key>n</arg_key><arg_value>{"x": [1, 2.5]}</arg_value></tool_call>'
              '<tool_call>get_time</tool_call>', "",
     [("get_weather", {"city": "Oslo", "n": {"x": [1, 2.5]}}), ("get_time", {})]),
    # the tag without a name after it, or an unfinished call: all of it is content
    ("glm45", "Hi <tool_call> not a call", "Hi <tool_call> not a call", []),
    # MiniMax-M2: two invokes in one block, a JSON value, a quoted and an unquoted name, a
    # string value on lines of its own
    ("minimax_m2", 'Let me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
                   '<parameter name="city">\na<b>c\n</parameter>\n<parameter name=n>'
                   '{"x": [1, 2.5]}</parameter>\n</invoke>\n<invoke name=\'get_time\'>\n'
                   '</invoke>\n</minimax:tool_call>', "Let me check.",
     [("get_weather", {"city": "a<b>c", "n": {"x": [1, 2.5]}}), ("get_time", {})]),
    ("minimax_m2", "Hi <minimax:tool_call> not a call", "Hi <minimax:tool_call> not a call",
     []),
    # a JSON value holding the end tag, and the invoke's end tag left out
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_time">\n<parameter name="zone">'
                   '{"a": "</parameter>"}</parameter>\n</minimax:tool_call>', "",
     [("get_time", {"zone": {"a": "</parameter>"}})]),
    # Qwen3-Coder: a block per call, values on lines of their own (a string keeps its inner
    # newline and its "<"), a JSON value, a call without parameters
    ("qwen3_coder", 'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n'
                    'a<b\nc\n</parameter>\n<parameter=n>\n{"x": [1, 2.5]}\n</parameter>\n'
                    '</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n'
                    '</function>\n</tool_call>', "Checking.",
     [("get_weather", {"city": "a<b\nc", "n": {"x": [1, 2.5]}}), ("get_time", {})]),
    ("qwen3_coder", "Hi <tool_call> not a call", "Hi <tool_call> not a call", []),
    # as vLLM reads it: end tags left out (a value ends at the next parameter or the
    # function's end, a function at the block's end), an end tag that text follows kept in
    # the value, Python literals for non-string values
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "<parameter=n>\n5\n</function>\n</tool_call>", "",
     [("get_weather", {"city": "Paris", "n": 5})]),
    # pythonic (Llama-3.2 / Llama-4): a list of calls, Python literals in either quotes,
    # brackets and quotes inside values, JSON's true, a tuple, Llama-4's tags
    ("pythonic", '[get_weather(city="Paris, (FR)", unit=\'c\'), get_time(zone="UTC", '
                 'flag=True, opts={"k": [1, None]}, pair=(1, 2), raw=true)]', "",
     [("get_weather", {"city": "Paris, (FR)", "unit": "c"}),
      ("get_time", {"zone": "UTC", "flag": True, "opts": {"k": [1, None]}, "pair": [1, 2],
                    "raw": True})]),
    ("llama4_pythonic", '<|python_start|>[get_time(zone="it\'s \\"x\\"")]<|python_end|>',
     "", [("get_time", {"zone": "it's \"x\""})]),
    ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ("pythonic", "Call me [maybe](later)", "Call me [maybe](later)", []),
    ("pythonic", "[get_time]", "[get_time]", []),
    ("qwen3_coder", "Ok.\n<tool_call>\n<function=get_time>\n<parameter=zone>\n"
                    "U</parameter>TC\n</parameter>\n<parameter=flag>\nTrue\n</parameter>\n"
                    "<parameter=opts>\n{'k': None}\n</parameter>\n</tool_call>", "Ok.",
     [("get_time", {"zone": "U</parameter>TC", "flag": True, "opts": {"k": None}})]),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse_finished_text(name: str, text: str, content: str, calls: list) -> None:
    got_content, got_calls = get_parser(name).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize("name,text,content,calls", CASES)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_streaming_chunks_add_up(name: str, text: str, content: str, calls: list,
                                 chunk: int) -> None:
    streamed_content, streamed_calls, has_calls = stream_text(name, text, chunk)
    assert streamed_content == content  # what parse() gives, trailing whitespace included
    assert [(n, json.loads(a)) for n, a in streamed_calls] == calls
    assert has_calls == bool(calls)


def stream_text(name: str, text: str, chunk: int, tools: list[dict] | None = None
                ) -> tuple[str, list[tuple[str, str]], bool]:
    """(content, [(name, arguments text)], has_calls) that the stream of `text` growing by
    `chunk` characters sends (with the request's `tools`, for formats that read them)."""
    stream = ToolCallStream(get_parser(name, None, tools))
    streamed_content = ""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    ids: dict[int, str] = {}
    for end in list(range(chunk, len(text), chunk)) + [len(text)]:
        delta, tool_deltas = stream.update(text[:end], final=end == len(text))
        streamed_content += delta
        for d in tool_deltas:
            index = d["index"]
            if "id" in d:  # the first delta of a call: id, type, name, empty arguments
                assert index not in ids and d["type"] == "function"
                assert d["function"]["arguments"] == ""
                ids[index], names[index] = d["id"], d["function"]["name"]
            arguments[index] = arguments.get(index, "") + d["function"]["arguments"]
    return streamed_content, [(names[i], arguments[i]) for i in sorted(names)], stream.has_calls


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_a_call_cut_off_does_not_finish_as_tool_calls(chunk: int) -> None:
    # max_tokens cut the call: parse() finds no call, so the finish stays "length"; the call
    # begun (its name read, as a stream sent it) is not content either
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert get_parser("hermes").parse(text) == ("", [])
    stream = ToolCallStream(get_parser("hermes"))
    for end in list(range(chunk, len(text), chunk)) + [len(text)]:
        stream.update(text[:end], final=end == len(text))
    assert not stream.has_calls


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_a_call_begun_and_cut_is_no_content_streamed_or_not(chunk: int) -> None:
    """A stop string ended the output inside a call: the chat message's content is the text
    before it (not the raw call), as the stream sends it."""
    plan = plan_tools(_chat(tools=[WEATHER]), "hermes", "")
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    message, called = tool_message(plan, text)
    assert message["content"] == "Sure." and not called
    assert stream_text("hermes", text, chunk)[0] == "Sure."


def test_detect_parser_from_template() -> None:
    assert detect_parser_name("{{ '<tool_call>' }}") == "hermes"
    assert detect_parser_name("[TOOL_CALLS]") == "mistral"
    assert detect_parser_name("<|python_tag|>{{ x }}") == "llama3"
    assert detect_parser_name("<|im_start|>") == "hermes"  # the default
    assert detect_parser_name("{{ '<tool_call>\\n<function=' + name }}") == "qwen3_coder"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_parser("nope")


def _matcher(ebnf: str):
    import xgrammar

    tokenizer = xgrammar.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\n"])
    compiled = xgrammar.GrammarCompiler(tokenizer).compile_grammar(
        xgrammar.Grammar.from_ebnf(ebnf))
    return xgrammar.GrammarMatcher(compiled)


def _accepts(ebnf: str, text: str) -> bool:
    matcher = _matcher(ebnf)
    return matcher.accept_string(text) and matcher.is_completed()


ONE_CALL = [ToolCall("get_weather", '{"city": "Paris", "unit": "c"}')]
TWO_CALLS = ONE_CALL + [ToolCall("get_time", '{"zone": "UTC"}')]


@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral", "deepseek_v3",
                                  "deepseek_v31", "glm45", "glm47", "minimax_m2",
                                  "qwen3_coder", "pythonic"])
def test_forced_call_grammar_accepts_what_the_parser_reads(name: str, parallel: bool) -> None:
    parser = get_parser(name)
    ebnf = forced_call_ebnf(parser, [WEATHER, TIME], parallel)
    text = parser.format_calls(ONE_CALL)
    assert parser.parse(text)[1][0].name == "get_weather"
    assert _accepts(ebnf, text)
    wrong = parser.format_calls([ToolCall("get_weather", '{"city": "Paris", "unit": "k"}')])
    assert not _matcher(ebnf).accept_string(wrong)


@pytest.mark.parametrize("name,several", [("hermes", True), ("mistral", True),
                                          ("llama3", False), ("deepseek_v3", True),
                                          ("deepseek_v31", True), ("glm45", True),
                                          ("glm47", True), ("minimax_m2", True),
                                          ("qwen3_coder", True), ("pythonic", True)])
def test_forced_grammar_allows_several_calls_only_when_parallel(name: str,
                                                                several: bool) -> None:
    """hermes (one <tool_call> block per call), mistral (one JSON array) and deepseek (one
    section of calls) can hold several calls in one answer; llama3's format is one call per
    message."""
    parser = get_parser(name)
    text = parser.format_calls(TWO_CALLS)
    assert [c.name for c in parser.parse(text)[1]] == ["get_weather", "get_time"]
    assert _accepts(forced_call_ebnf(parser, [WEATHER, TIME], parallel=True), text) == several
    assert not _accepts(forced_call_ebnf(parser, [WEATHER, TIME], parallel=False), text)
    # the answer may not end between calls, nor after an unfinished wrapper
    between = text[:text.index("get_time") - len('{"name": "')]
    if name.startswith("deepseek"):  # the first call's end marker, the section's end missing
        between = text[:text.rindex("<｜tool▁call▁begin｜>")]
    if name.startswith(("glm", "minimax", "qwen3", "pythonic")):  # the first call whole,
        # the second's
        # tag begun
        between = text[:text.rindex("get_time")]
    assert not _accepts(forced_call_ebnf(parser, [WEATHER, TIME], parallel=True), between)


def _chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_tool_choice_plans() -> None:
    assert not plan_tools(_chat(), None, "").parse_output
    # "none": rendered by a template that renders tools, not parsed; no system prompt of
    # tools for a template without them (it would teach a call nothing parses)
    template = "{% if tools %}{{ tools }}{% endif %}"
    none = plan_tools(_chat(tools=[WEATHER], tool_choice="none"), None, template)
    assert not none.parse_output and none.tools == [WEATHER]
    assert plan_tools(_chat(tools=[WEATHER], tool_choice="none"), None, "").tools == []
    excluded = plan_tools(_chat(tools=[WEATHER], tool_choice="none"), None, template, True)
    assert not excluded.parse_output and excluded.tools == []
    auto = plan_tools(_chat(tools=[WEATHER]), None, "")
    assert auto.parse_output and auto.forced_ebnf is None
    named = plan_tools(_chat(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}), None, "")
    assert "get_time" in named.forced_ebnf and "get_weather" not in named.forced_ebnf
    message, called = tool_message(named, '<tool_call>\n{"name": "get_time", "arguments": '
                                          '{"zone": "UTC"}}\n</tool_call>')
    assert called and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}


def test_parallel_tool_calls_plans() -> None:
    """required: one or more calls unless parallel_tool_calls is false; a named function is
    one call; false also keeps only the first call of an auto answer."""
    hermes_two = get_parser("hermes").format_calls(TWO_CALLS)
    for fields, parallel in [({}, True), ({"parallel_tool_calls": True}, True),
                             ({"parallel_tool_calls": False}, False)]:
        plan = plan_tools(_chat(tools=[WEATHER, TIME], tool_choice="required", **fields),
                          None, "")
        assert _accepts(plan.forced_ebnf, hermes_two) == parallel
        message, called = tool_message(plan, hermes_two)
        assert called and len(message["tool_calls"]) == (2 if parallel else 1)
    named = plan_tools(_chat(tools=[WEATHER, TIME], parallel_tool_calls=True, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), None, "")
    one = get_parser("hermes").format_calls(ONE_CALL)
    assert _accepts(named.forced_ebnf, one)
    assert not _accepts(named.forced_ebnf, get_parser("hermes").format_calls(ONE_CALL * 2))
    mistral = plan_tools(_chat(tools=[WEATHER, TIME], tool_choice="required"), "mistral", "")
    assert _accepts(mistral.forced_ebnf, get_parser("mistral").format_calls(TWO_CALLS))
    llama = plan_tools(_chat(tools=[WEATHER, TIME], tool_choice="required"), "llama3", "")
    assert not _accepts(llama.forced_ebnf, get_parser("llama3").format_calls(TWO_CALLS))
    auto = plan_tools(_chat(tools=[WEATHER, TIME], parallel_tool_calls=False), None, "")
    assert auto.forced_ebnf is None
    message, _ = tool_message(auto, hermes_two)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_stream_with_max_calls_sends_the_first_call_only(chunk: int) -> None:
    text = get_parser("mistral").format_calls(TWO_CALLS)
    stream = ToolCallStream(get_parser("mistral"), max_calls=1)
    deltas = []
    for end in list(range(chunk, len(text), chunk)) + [len(text)]:
        deltas += stream.update(text[:end], final=end == len(text))[1]
    assert {d["index"] for d in deltas} == {0}
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == \
        json.loads(TWO_CALLS[0].arguments)


def test_multi_turn_history_renders_through_the_template(smollm_tokenizer) -> None:
    body = _chat(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}], tools=[WEATHER])
    template = smollm_tokenizer.chat_template
    plan = plan_tools(body, None, template)
    prompt = smollm_tokenizer.apply_chat_template(render_conversation(body, plan, template),
                                                  tokenize=False, add_generation_prompt=True)
    # the tools in a system prompt (the template does not render tools), the call as hermes
    # text in the assistant turn, the result in a tool turn
    assert prompt.startswith("<|im_start|>system\nYou may call functions") and "get_weather" in prompt
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' \
        in prompt
    assert "<|im_start|>tool\n21 degrees<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_pythonic_forced_call_orders_required_arguments_first() -> None:
    """Required keyword arguments always, then any optional ones, commas only between them,
    values as JSON of their schema (JSON's true read as True); a tool without required
    parameters may be called bare."""
    book = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"late": {"type": "boolean"},
                                         "code": {"type": "string"},
                                         "nights": {"type": "integer"}},
        "required": ["code", "nights"]}}}
    ping = {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"verbose": {"type": "boolean"},
                                         "host": {"type": "string"}}}}}
    parser = get_parser("pythonic")
    ebnf = forced_call_ebnf(parser, [book, ping], parallel=True)
    for text in ('[book(code="A1", nights=2)]', '[book(code="A1", nights=2, late=true)]',
                 '[ping()]', '[ping(host="h")]', '[ping(verbose=false, host="h")]',
                 '[ping(), book(code="B", nights=1)]'):
        assert _accepts(ebnf, text), text
    for text in ('[book(nights=2, code="A1")]', '[book(code="A1")]', '[ping(, host="h")]',
                 '[book(code="A1", nights=2, )]', '[book(code=A1, nights=2)]'):
        assert not _accepts(ebnf, text), text
    _, calls = parser.parse('[book(code="A1", nights=2, late=true)]')
    assert json.loads(calls[0].arguments) == {"code": "A1", "nights": 2, "late": True}
    assert parser.format_calls(calls) == '[book(code="A1", nights=2, late=True)]'


def test_pythonic_answer_becomes_the_chat_messages_tool_calls() -> None:
    plan = plan_tools(_chat(tools=[WEATHER, TIME]), "llama4_pythonic", "")
    message, called = tool_message(
        plan, '<|python_start|>[get_weather(city="Oslo", unit="c"), get_time(zone="CET")]'
              '<|python_end|>')
    assert called and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Oslo", "unit": "c"}),
                                                ("get_time", {"zone": "CET"})]
    message, called = tool_message(plan, "It is sunny in Oslo.")
    assert not called and message["content"] == "It is sunny in Oslo."
