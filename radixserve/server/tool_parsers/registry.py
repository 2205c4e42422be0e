"""Which tool-call parser a server uses: `--tool-call-parser NAME`, else the one whose marker
the chat template writes, else hermes (the ChatML convention: a template that knows nothing
of tools gets the tools in a system prompt and answers in hermes' format).

DeepSeek's templates write `<｜tool▁calls▁begin｜>`; V3 / R1's write the call's type before
the sep (`function<｜tool▁sep｜>`, `tool['type'] + '<｜tool▁sep｜>'`) and fence the arguments
in "```json", V3.1's write the name before the sep and neither: a template with either V3
sign is deepseek_v3, any other deepseek_v31. The names are vLLM's (deepseek_v3, deepseek_v31)
and SGLang's (deepseekv3, deepseekv31)."""
from __future__ import annotations

import re

from radixserve.server.tool_parsers.base import ToolCallParser
from radixserve.server.tool_parsers.deepseek import (CALLS_BEGIN, SEP, DeepSeekV3Parser,
                                                     DeepSeekV31Parser)
from radixserve.server.tool_parsers.hermes import HermesParser
from radixserve.server.tool_parsers.llama3 import Llama3JsonParser
from radixserve.server.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser, "qwen25": HermesParser, "qwen3": HermesParser,
    "llama3": Llama3JsonParser, "mistral": MistralParser,
    "deepseek_v3": DeepSeekV3Parser, "deepseekv3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV31Parser, "deepseekv31": DeepSeekV31Parser,
}
DEFAULT_PARSER = "hermes"
# V3's type before the sep: the literal "function" or the template's tool['type'] / tool.type
_DEEPSEEK_V3_SEP = re.compile(r"""(?:\bfunction|\[\s*['"]type['"]\s*\]\s*\+\s*['"]|"""
                              r"""\.type\s*\+\s*['"])""" + re.escape(SEP))


def detect_parser_name(chat_template: str | None) -> str:
    """The parser a chat template's text implies."""
    template = chat_template or ""
    if CALLS_BEGIN in template:
        v3 = "```json" in template or _DEEPSEEK_V3_SEP.search(template)
        return "deepseek_v3" if v3 else "deepseek_v31"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return DEFAULT_PARSER


def get_parser(name: str | None, chat_template: str | None = None) -> ToolCallParser:
    """The parser named (one of PARSERS), or the one detected from the template."""
    chosen = name or detect_parser_name(chat_template)
    if chosen not in PARSERS:
        raise ValueError(f"unknown tool-call parser {chosen!r}; choose from "
                         f"{', '.join(sorted(PARSERS))}")
    return PARSERS[chosen]()
