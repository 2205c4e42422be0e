"""The grammar that forces tool calls (tool_choice "required" or a named function): an
xgrammar EBNF of the parser's wrapper around {"name": <one of the tools>, <arguments_key>:
<that tool's parameters schema>}, so the calls always parse and their arguments validate.
One call, or with `parallel` one or more where the format can hold several in one answer
(the parser's `grammar_between`: hermes' blocks, mistral's array, deepseek's calls; llama3
stays at one). A format whose calls are not JSON objects (DeepSeek's) gives the literal text
around each tool's arguments instead (`ToolCallParser.call_literals`): one alternative per
tool, the literals (the tool's name among them) around its parameters schema."""
from __future__ import annotations

import json
from typing import Any

from radixserve.scheduler.grammar.validation import JSON_SCHEMA_OPTIONS
from radixserve.server.tool_parsers.base import ToolCallParser

_ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}
# the rule of the whole answer; the call schema's own root becomes a rule it refers to
# (xgrammar prints the grammar's root rule as `root`, renaming the schema's)
_CALLS_RULE = "radixserve_forced_tool_calls"


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


def forced_call_ebnf(parser: ToolCallParser, tools: list[dict[str, Any]],
                     parallel: bool = False) -> str:
    """EBNF text (for the `ebnf` sampling parameter) of exactly one call of one of `tools`,
    or with `parallel` of one or more where the parser's format can hold several."""
    import xgrammar

    call = _call_grammar(parser, tools)
    before, after = parser.grammar_parts()
    calls = "root"
    if parallel and parser.grammar_between is not None:
        calls = f"root ({_literal(parser.grammar_between)} root)*"
    body = " ".join(part for part in (_literal(before), calls, _literal(after)) if part)
    grammar = xgrammar.Grammar.from_ebnf(f"{_CALLS_RULE} ::= {body}\n{call}",
                                         root_rule_name=_CALLS_RULE)
    return str(grammar)


def _call_grammar(parser: ToolCallParser, tools: list[dict[str, Any]]) -> Any:
    """The xgrammar Grammar of one call of one of `tools` (its root rule `root`)."""
    import xgrammar

    literals = [parser.call_literals(tool["function"]["name"]) for tool in tools]
    if None in literals:
        return xgrammar.Grammar.from_json_schema(
            json.dumps(call_schema(tools, parser.arguments_key)), **JSON_SCHEMA_OPTIONS)
    options = []
    for tool, (before, after) in zip(tools, literals):  # type: ignore[misc]
        arguments = xgrammar.Grammar.from_json_schema(
            json.dumps(tool["function"].get("parameters") or _ANY_OBJECT), **JSON_SCHEMA_OPTIONS)
        options.append(xgrammar.Grammar.concat(
            xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(before)}"), arguments,
            xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(after)}")))
    return options[0] if len(options) == 1 else xgrammar.Grammar.union(*options)


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""
