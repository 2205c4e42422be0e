"""Which tool-call parser a server uses: `--tool-call-parser NAME`, else the one whose marker
the chat template writes, else hermes (the ChatML convention: a template that knows nothing
of tools gets the tools in a system prompt and answers in hermes' format).

DeepSeek's templates write `<｜tool▁calls▁begin｜>`; V3 / R1's write the call's type before
the sep (`function<｜tool▁sep｜>`, `tool['type'] + '<｜tool▁sep｜>'`) and fence the arguments
in "```json", V3.1's write the name before the sep and neither: a template with either V3
sign is deepseek_v3, any other deepseek_v31. The names are vLLM's (deepseek_v3, deepseek_v31)
and SGLang's (deepseekv3, deepseekv31).

Qwen3-Coder's, Qwen3.5's and Nemotron-3's templates write `<function=` inside `<tool_call>`
(qwen3_coder, so told apart from hermes' JSON calls first). GLM's write `<arg_key>` (and
`<tool_call>`, so they are told apart from hermes' first): glm45 where a newline separates
`</arg_key>` from `<arg_value>` (GLM-4.5 / 4.6), glm47 where nothing does (GLM-4.7).
gpt-oss's (`<|channel|>`) is openai (tool_parsers/harmony.py, vLLM's name; also `harmony`).
MiniMax-M2's (`<minimax:tool_call>`) is minimax_m2. Pythonic calls (Llama-3.2's and
Llama-4's `[f(a=1)]`, tool_parsers/pythonic.py) are named by the flag only (`pythonic`, or
vLLM's `llama4_pythonic`); vLLM's `llama3_json` / `llama4_json` name llama3's JSON calls."""
from __future__ import annotations

import re
from typing import Any

from radixserve.server.tool_parsers.base import ToolCallParser
from radixserve.server.tool_parsers.deepseek import (CALLS_BEGIN, SEP, DeepSeekV3Parser,
                                                     DeepSeekV31Parser)
from radixserve.server.tool_parsers.glm import KEY_END, VALUE_BEGIN, Glm45Parser, Glm47Parser
from radixserve.server.tool_parsers.harmony import HarmonyToolParser
from radixserve.server.tool_parsers.hermes import HermesParser
from radixserve.server.tool_parsers.llama3 import Llama3JsonParser
from radixserve.server.tool_parsers.minimax import BLOCK_BEGIN, MiniMaxM2Parser
from radixserve.server.tool_parsers.mistral import MistralParser
from radixserve.server.tool_parsers.pythonic import PythonicParser
from radixserve.server.tool_parsers.qwen3_coder import FUNCTION_BEGIN, Qwen3CoderParser

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser, "qwen25": HermesParser, "qwen3": HermesParser,
    "llama3": Llama3JsonParser, "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser, "mistral": MistralParser,
    "pythonic": PythonicParser, "llama4_pythonic": PythonicParser,
    "deepseek_v3": DeepSeekV3Parser, "deepseekv3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV31Parser, "deepseekv31": DeepSeekV31Parser,
    "glm45": Glm45Parser, "glm47": Glm47Parser,
    "openai": HarmonyToolParser, "harmony": HarmonyToolParser,
    "minimax_m2": MiniMaxM2Parser, "minimax-m2": MiniMaxM2Parser,
    "qwen3_coder": Qwen3CoderParser,
}
DEFAULT_PARSER = "hermes"
# V3's type before the sep: the literal "function" or the template's tool['type'] / tool.type
_DEEPSEEK_V3_SEP = re.compile(r"""(?:\bfunction|\[\s*['"]type['"]\s*\]\s*\+\s*['"]|"""
                              r"""\.type\s*\+\s*['"])""" + re.escape(SEP))


# gpt-oss's template writes the Harmony channels
HARMONY_TEMPLATE_SIGN = "<|channel|>"
# what a GLM template writes between a key's end tag and the value's begin tag (a newline,
# or the escape "\n" inside a string literal, in 4.5 / 4.6's)
_GLM_BETWEEN = re.compile(re.escape(KEY_END) + r"(.{0,16}?)" + re.escape(VALUE_BEGIN), re.S)


def detect_parser_name(chat_template: str | None) -> str:
    """The parser a chat template's text implies."""
    template = chat_template or ""
    if HARMONY_TEMPLATE_SIGN in template:
        return "openai"
    if CALLS_BEGIN in template:
        v3 = "```json" in template or _DEEPSEEK_V3_SEP.search(template)
        return "deepseek_v3" if v3 else "deepseek_v31"
    if BLOCK_BEGIN in template:
        return "minimax_m2"
    if "<arg_key>" in template:  # GLM: 4.5 / 4.6 put a newline between key and value
        between = _GLM_BETWEEN.search(template)
        newline = between is not None and ("\n" in between.group(1) or "\\n" in between.group(1))
        return "glm45" if newline else "glm47"
    if FUNCTION_BEGIN in template and "<tool_call>" in template:  # Qwen3-Coder's
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return DEFAULT_PARSER


def get_parser(name: str | None, chat_template: str | None = None,
               tools: list[dict[str, Any]] | None = None) -> ToolCallParser:
    """The parser named (one of PARSERS), or the one detected from the template, for a
    request with these tools."""
    chosen = name or detect_parser_name(chat_template)
    if chosen not in PARSERS:
        raise ValueError(f"unknown tool-call parser {chosen!r}; choose from "
                         f"{', '.join(sorted(PARSERS))}")
    return PARSERS[chosen](tools)
