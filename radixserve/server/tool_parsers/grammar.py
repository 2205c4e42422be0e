"""The grammar that forces one tool call (tool_choice "required" or a named function): an
xgrammar EBNF of the parser's wrapper around {"name": <one of the tools>, <arguments_key>:
<that tool's parameters schema>}, so the call always parses and its arguments validate."""
from __future__ import annotations

import json
from typing import Any

from radixserve.scheduler.grammar.validation import JSON_SCHEMA_OPTIONS
from radixserve.server.tool_parsers.base import ToolCallParser

_ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}


def call_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """JSON schema of one call of any of `tools` (OpenAI tool dicts)."""
    options = []
    for tool in tools:
        function = tool["function"]
        options.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]},
                           arguments_key: function.get("parameters") or _ANY_OBJECT},
            "required": ["name", arguments_key]})
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_call_ebnf(parser: ToolCallParser, tools: list[dict[str, Any]]) -> str:
    """EBNF text (for the `ebnf` sampling parameter) of exactly one call of one of `tools`."""
    import xgrammar

    before, after = parser.grammar_parts()
    parts = [xgrammar.Grammar.from_json_schema(json.dumps(call_schema(tools,
                                                                      parser.arguments_key)),
                                               **JSON_SCHEMA_OPTIONS)]
    if before:
        parts.insert(0, xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(before)}"))
    if after:
        parts.append(xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(after)}"))
    grammar = parts[0] if len(parts) == 1 else xgrammar.Grammar.concat(*parts)
    return str(grammar)
