"""Which tool-call parser a server uses: `--tool-call-parser NAME`, else the one whose marker
the chat template writes, else hermes (the ChatML convention: a template that knows nothing
of tools gets the tools in a system prompt and answers in hermes' format)."""
from __future__ import annotations

from radixserve.server.tool_parsers.base import ToolCallParser
from radixserve.server.tool_parsers.hermes import HermesParser
from radixserve.server.tool_parsers.llama3 import Llama3JsonParser
from radixserve.server.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser, "qwen25": HermesParser, "qwen3": HermesParser,
    "llama3": Llama3JsonParser, "mistral": MistralParser,
}
DEFAULT_PARSER = "hermes"


def detect_parser_name(chat_template: str | None) -> str:
    """The parser a chat template's text implies."""
    template = chat_template or ""
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
