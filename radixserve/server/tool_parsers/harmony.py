"""gpt-oss's tool calls (`--tool-call-parser openai`, vLLM's name; also `harmony`): messages
addressed to `functions.NAME` whose body is the arguments' JSON. The Harmony split
(server/harmony.py) has already turned the output into its answer text followed by each call in
one canonical form, `<|channel|>commentary to=functions.NAME<|message|>ARGS[<|call|>]`, which
this parser reads: the name once the header is complete, the arguments as far as they have come,
complete at `<|call|>` only (the chat route puts that EOS back at the text's end,
harmony.with_call_end; a call cut by a stop string or max_tokens stays unfinished). A forced
call's grammar is the model's own header around the tool's parameters schema; the call's end is
the EOS `<|call|>`. One call per message and per turn (`<|call|>` ends the output)."""
from __future__ import annotations

import json

from radixserve.server.harmony import CALL, CALL_OPEN, CONSTRAIN, FUNCTIONS, MARKERS, MESSAGE
from radixserve.server.tool_parsers.base import PartialCall, Scan, ToolCall, ToolCallParser


class HarmonyToolParser(ToolCallParser):
    name = "openai"
    marker = CALL_OPEN
    markers = MARKERS

    def scan(self, text: str, final: bool = False) -> Scan:
        content_end, pos = self.section_start(text, final)
        scan = Scan(content_end)
        while text.startswith(CALL_OPEN, pos):
            header_end = text.find(MESSAGE, pos)
            if header_end < 0:
                break
            # the canonical header, or the model's own where no split ran first (a forced
            # call's output: `... to=functions.NAME <|constrain|>json<|message|>`)
            recipient = (text[pos + len(CALL_OPEN):header_end].replace("<|", " <|").split()
                         or [""])[0]
            start = header_end + len(MESSAGE)
            end = text.find(CALL, start)
            name = recipient[len(FUNCTIONS):] if recipient.startswith(FUNCTIONS) else None
            if end < 0:
                body = text[start:]
                scan.calls.append(PartialCall(name, body.strip(), False))
                break
            scan.calls.append(PartialCall(name, text[start:end].strip(), True))
            pos = end + len(CALL)
        return scan

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "".join(self._call_text(c.name, c.arguments) for c in calls)

    def _call_text(self, name: str, arguments: str) -> str:
        before, after = self.call_literals(name)
        return f"{before}{json.dumps(json.loads(arguments))}{after}"

    def wrap_call(self, call_json: str) -> str:
        call = json.loads(call_json)
        return self._call_text(call["name"], json.dumps(call["arguments"]))

    def grammar_parts(self) -> tuple[str, str]:
        return "", ""

    def call_literals(self, name: str) -> tuple[str, str]:
        """The header the model writes before a call's arguments (the grammar's `<|call|>`
        is its EOS, outside the grammar)."""
        return f"{CALL_OPEN}{FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}", ""
