"""The grammar that forces tool calls (tool_choice "required" or a named function): an
xgrammar EBNF of the parser's wrapper around {"name": <one of the tools>, <arguments_key>:
<that tool's parameters schema>}, so the calls always parse and their arguments validate.
One call, or with `parallel` one or more where the format can hold several in one answer
(the parser's `grammar_between`: hermes' blocks, mistral's array, deepseek's calls; llama3
stays at one). A format whose calls are not JSON objects (DeepSeek's) gives the literal text
around each tool's arguments instead (`ToolCallParser.call_literals`): one alternative per
tool, the literals (the tool's name among them) around its parameters schema; a format
writing key / value pairs (GLM's, `ToolCallParser.argument_pairs`) gets one pair per
property, the value as text for a string parameter and as JSON of its schema otherwise."""
from __future__ import annotations

import json
from typing import Any

from radixserve.scheduler.grammar.validation import JSON_SCHEMA_OPTIONS
from radixserve.server.tool_parsers.base import ToolCallParser
from radixserve.server.tool_parsers.glm import is_text_parameter

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
    pairs = parser.argument_pairs()
    options = []
    for tool, (before, after) in zip(tools, literals):  # type: ignore[misc]
        if pairs is not None and parser.pair_separator is not None:
            arguments = _separated_pairs_grammar(tool, pairs[1], parser.pair_separator)
        elif pairs is not None:
            arguments = _pairs_grammar(tool, pairs, parser.text_values)
        else:
            arguments = xgrammar.Grammar.from_json_schema(
                json.dumps(tool["function"].get("parameters") or _ANY_OBJECT),
                **JSON_SCHEMA_OPTIONS)
        options.append(xgrammar.Grammar.concat(_literal_grammar(before), arguments,
                                               _literal_grammar(after)))
    return options[0] if len(options) == 1 else xgrammar.Grammar.union(*options)


def _pairs_grammar(tool: dict[str, Any], pairs: tuple[str, str, str],
                   text_values: bool = True) -> Any:
    """The key / value pairs of one call's arguments: one per property of the tool's
    parameters schema, in its order, the required ones always and the others optionally;
    a schema without properties takes any keys with text values (none where the format
    writes no text values: pythonic calls)."""
    import xgrammar

    key_before, key_after, value_after = pairs
    text_value = text_without(value_after.strip()) if text_values else None
    schema = tool["function"].get("parameters") or _ANY_OBJECT
    properties = schema.get("properties") or {}
    if not properties:
        if text_value is None:
            return _literal_grammar("")
        return xgrammar.Grammar.from_ebnf(
            f"root ::= ({_literal(key_before)} [^<]+ {_literal(key_after)} {text_value} "
            f"{_literal(value_after)})*")
    required = set(schema.get("required") or ())
    parts = []
    for key, value_schema in properties.items():
        pair = xgrammar.Grammar.concat(_literal_grammar(key_before + key + key_after),
                                       _value_grammar(value_schema, text_value),
                                       _literal_grammar(value_after))
        parts.append(pair if key in required else
                     xgrammar.Grammar.union(pair, _literal_grammar("")))
    return parts[0] if len(parts) == 1 else xgrammar.Grammar.concat(*parts)


def _separated_pairs_grammar(tool: dict[str, Any], key_after: str, separator: str) -> Any:
    """Keyword arguments `key<key_after><JSON value>` with `separator` between them (pythonic
    calls): the required properties first, in the schema's order, then each optional one or
    not; none for a schema without properties."""
    import xgrammar

    schema = tool["function"].get("parameters") or _ANY_OBJECT
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())

    def pair(key: str) -> Any:
        value = properties[key]
        return xgrammar.Grammar.concat(_literal_grammar(key + key_after), xgrammar.Grammar.
                                       from_json_schema(json.dumps(
                                           value if isinstance(value, dict) else _ANY_OBJECT),
                                           **JSON_SCHEMA_OPTIONS))

    def optional(*parts: Any) -> Any:
        return xgrammar.Grammar.union(xgrammar.Grammar.concat(*parts) if len(parts) > 1
                                      else parts[0], _literal_grammar(""))

    firsts = [key for key in properties if key in required]
    optionals = [key for key in properties if key not in required]
    separated = [xgrammar.Grammar.concat(_literal_grammar(separator), pair(key))
                 for key in optionals]
    if firsts:
        parts = [pair(firsts[0])]
        parts += [xgrammar.Grammar.concat(_literal_grammar(separator), pair(key))
                  for key in firsts[1:]]
        parts += [optional(part) for part in separated]
        return parts[0] if len(parts) == 1 else xgrammar.Grammar.concat(*parts)
    if not optionals:
        return _literal_grammar("")
    # no required one: the first present optional one has no separator before it
    choices = [_literal_grammar("")]
    for i, key in enumerate(optionals):
        rest = [optional(part) for part in separated[i + 1:]]
        choices.append(xgrammar.Grammar.concat(pair(key), *rest) if rest else pair(key))
    return xgrammar.Grammar.union(*choices)


# a length-bounded string argument's text, counted in units: anything but "</" and a final
# "<" (a unit is a character, or a "<" run with the character after it)
_TEXT_UNIT = '[^<] | "<"+ [^/<]'


def text_without(end_tag: str) -> str:
    """EBNF of any text that does not hold `end_tag` (a value's closing tag, "<" then no
    other "<"), so the tag after the value is where the value ends: code with "</div>" or
    "a </ b" is a value, "</parameter>" inside one is not. After each "<" the text either
    stops short of the tag's rest (a proper prefix of it, maybe empty) or leaves it at some
    character and runs on to the next "<"."""
    if not end_tag.startswith("<") or "<" in end_tag[1:]:
        raise ValueError(f"not a closing tag: {end_tag!r}")
    rest = end_tag[1:]
    branches = [json.dumps(rest[:k]) if k else '""' for k in range(len(rest))]
    branches += [f"{json.dumps(rest[:k]) if k else ''} [^<{_class_char(rest[k])}] [^<]*"
                 for k in range(len(rest))]
    return f'[^<]* ("<" ({" | ".join(branches)}))*'


def _class_char(char: str) -> str:
    return "\\" + char if char in "\\]^-" else char


def _value_grammar(schema: Any, text_value: str | None) -> Any:
    """One argument's value: for a parameter written as text (glm.is_text_parameter, where the
    format writes text values: `text_value` given) its text, one of those listed where the
    schema lists them, else JSON of its schema."""
    import xgrammar

    if text_value is not None and is_text_parameter(schema):
        values = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
        if values:
            return xgrammar.Grammar.union(*(_literal_grammar(v) for v in values))
        return _text_grammar(schema, text_value)
    return xgrammar.Grammar.from_json_schema(
        json.dumps(schema if isinstance(schema, dict) else _ANY_OBJECT), **JSON_SCHEMA_OPTIONS)


def _text_grammar(schema: dict[str, Any], text_value: str) -> Any:
    """A string parameter's text: its `pattern` (anchors dropped: the value is the whole
    match), else any text without the value's end tag (`text_value`, see text_without), or
    with `minLength` / `maxLength` any text of that many units (_TEXT_UNIT: no "</" there)."""
    import xgrammar

    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        if pattern.endswith("$") and not pattern.endswith("\\$"):  # an anchor, not a "\$"
            pattern = pattern[:-1]
        return xgrammar.Grammar.from_regex(pattern.removeprefix("^"))
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        low = low if isinstance(low, int) else 0
        high = high if isinstance(high, int) else -1
        return xgrammar.Grammar.from_ebnf(f"root ::= ({_TEXT_UNIT}){{{low}, {high}}}")
    return xgrammar.Grammar.from_ebnf(f"root ::= {text_value}")


def _literal_grammar(text: str) -> Any:
    import xgrammar
    return xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""
