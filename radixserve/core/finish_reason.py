"""Why a request stopped. Serialised as SGLang does: {"type": ..., "matched"/"length"/"message"}."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FinishReason:
    kind: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string that ended it
    length: int | None = None
    message: str | None = None

    @classmethod
    def stop_token(cls, token_id: int) -> "FinishReason":
        return cls("stop", matched=token_id)

    @classmethod
    def stop_str(cls, text: str) -> "FinishReason":
        return cls("stop", matched=text)

    @classmethod
    def max_length(cls, length: int) -> "FinishReason":
        return cls("length", length=length)

    @classmethod
    def abort(cls, message: str = "aborted") -> "FinishReason":
        return cls("abort", message=message)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        if self.kind == "stop":
            out["matched"] = self.matched
        elif self.kind == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
        return out
