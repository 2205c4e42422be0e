"""gpt-oss's output format (OpenAI Harmony), split into reasoning, answer and tool calls.

The chat template ends the prompt with `<|start|>assistant`; the model then writes messages

  <|channel|>analysis<|message|>REASONING<|end|>
  <|start|>assistant<|channel|>final<|message|>ANSWER            (then <|return|>, an EOS)
  <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS
                                                                (then <|call|>, an EOS)

(the recipient may also follow the role: `<|start|>assistant to=functions.NAME<|channel|>...`).
All seven tags are special tokens: requests keep them in the output text (`MARKERS`).

`split_harmony` gives (reasoning, answer) as the reasoning parsers do (server/reasoning.py): the
reasoning is the analysis messages' text; the answer is the text of the final messages and of
commentary messages without a recipient (preambles), followed by each message addressed to a
function, written canonically (`<|channel|>commentary to=functions.NAME<|message|>ARGS`,
`<|call|>` once it is complete), which `HarmonyToolParser` (tool_parsers/harmony.py) reads (left
out where the request parses no calls). Messages are joined by a newline. Messages to other
recipients (the built-in browser and python tools, which radixserve does not run) are left out.
A constrained answer (response_format) skips the analysis: the chat route ends its prompt with
`<|channel|>final<|message|>` (`CONSTRAINED_ANSWER`, where the prompt ends with the generation
prompt), so the grammar applies to the final message from its first token. An output without any
message tag (tags stripped, or a model that skipped them) is all answer; one that ends inside
its first header has none. A call is complete at `<|call|>`: that EOS is not in the output's
text, so the chat route appends it where the output ended with that token (`with_call_end`); a
call cut by a stop string or by max_tokens stays unfinished. Messages after a call are left out.
While unfinished, a message whose header is incomplete is left out and a tail that may still be
a tag is held back, so the answer and reasoning only grow."""
from __future__ import annotations

from dataclasses import dataclass

from radixserve.server.partial_text import held_back

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
FUNCTIONS = "functions."
CALL_OPEN = f"{CHANNEL}commentary to="  # a canonical call in the answer
CONSTRAINED_ANSWER = f"{CHANNEL}final{MESSAGE}"  # the prompt's end for a constrained answer
HARMONY_ASSISTANT = f"{START}assistant"  # where the template's generation prompt ends
_BODY_ENDS = (END, CALL, RETURN, START)


@dataclass
class HarmonyMessage:
    channel: str | None
    recipient: str | None
    body: str
    complete: bool  # its end tag came


def parse_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of an output so far (see the module's text)."""
    messages: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        tag = text.find(MESSAGE, pos)
        if tag < 0:
            break  # a header still being written (or text after the last message)
        channel, recipient = _header(text[pos:tag])
        start = tag + len(MESSAGE)
        ends = [(found, end) for end in _BODY_ENDS if (found := text.find(end, start)) >= 0]
        if ends:
            found, end = min(ends)
            messages.append(HarmonyMessage(channel, recipient, text[start:found], True))
            pos = found + (0 if end == START else len(end))
            continue
        body = text[start:]
        if not final:
            body = body[:len(body) - held_back(body, *MARKERS)]
        # the output's end closes a message, but a call only at <|call|>: a stop string, or
        # <|return|>, inside a call's arguments leaves the call unfinished
        messages.append(HarmonyMessage(channel, recipient, body, final and recipient is None))
        break
    return messages


def split_harmony(text: str, final: bool = True,
                  keep_calls: bool = True) -> tuple[str | None, str]:
    """(reasoning or None, answer) of an output so far; see the module's text. keep_calls
    False (the request parses no tool calls): messages to functions are left out too."""
    if MESSAGE not in text:
        opening = text.lstrip()
        if opening.startswith("<|") or any(m.startswith(opening) for m in MARKERS):
            return None, ""  # a header still being written, or cut off: no answer yet
        return None, text if final else text[:len(text) - held_back(text, *MARKERS)]
    reasoning: list[str] = []
    answer: list[str] = []
    calls: list[str] = []
    for message in parse_messages(text, final):
        if calls:
            break  # a call ends the turn (<|call|>); what a malformed output wrote after it
            # would come after the call in the answer, where no stream could send it
        if message.recipient is not None:
            if keep_calls and message.recipient.startswith(FUNCTIONS):
                calls.append(f"{CALL_OPEN}{message.recipient}{MESSAGE}{message.body}"
                             f"{CALL if message.complete else ''}")
        elif message.channel == "analysis":
            reasoning.append(message.body)
        else:  # final, a commentary preamble, or a message without a channel
            answer.append(message.body)
    return ("\n".join(reasoning) if reasoning else None), "\n".join(answer) + "".join(calls)


def with_call_end(text: str, finish_reason: dict | None, call_token: int | None,
                  forced_call: bool = False) -> str:
    """The output's text with `<|call|>` back at its end where that token (an EOS, which the
    text leaves out) ended it; for a forced call (its grammar complete before any EOS is
    allowed) where any stop token did."""
    matched = (finish_reason or {}).get("matched")
    if (call_token is not None and matched == call_token) or \
            (forced_call and isinstance(matched, int)):
        return text + CALL
    return text


def _header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header: `[<|start|>]ROLE[ to=R]<|channel|>NAME[ to=R]
    [<|constrain|>json | json]`, the role and channel optional."""
    channel = recipient = None
    if CHANNEL in header:
        words = header[header.index(CHANNEL) + len(CHANNEL):].replace("<|", " <|").split()
        channel = words[0] if words and not words[0].startswith("<|") else None
    for word in header.replace("<|", " <|").split():
        if word.startswith("to="):
            recipient = word[3:]
    return channel, recipient
