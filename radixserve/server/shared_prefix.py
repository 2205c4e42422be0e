"""Parallel sampling (n > 1): each repeated prompt is prefilled once, by an internal request
with max_new_tokens 0 (`plan_warmups`), before its copies are sent, so they hit the radix
cache instead of prefilling n times (as SGLang does). Until a copy is sent, `WaitingCopies`
knows it: an abort meanwhile must not be lost (it is applied as the copy is sent), and its
rid is in use."""
from __future__ import annotations

import uuid
from dataclasses import replace

from radixserve.server.request_state import GenerateRequest


PromptKey = tuple  # (LoRA adapter or None, prompt ids...): KV is shared within an adapter


def prompt_key(req: GenerateRequest) -> PromptKey:
    images = tuple(image.hash for image in req.mm_inputs or ())
    return (req.lora_name, images, *req.input_ids)


def plan_warmups(reqs: list[GenerateRequest]) -> dict[PromptKey, GenerateRequest]:
    """The warm-up of each prompt that more than one of `reqs` has, by prompt."""
    first_of: dict[PromptKey, GenerateRequest] = {}
    repeated: dict[PromptKey, GenerateRequest] = {}
    for req in reqs:
        key = prompt_key(req)
        if key in first_of:
            repeated[key] = first_of[key]
        else:
            first_of[key] = req
    return {key: replace(r, rid=uuid.uuid4().hex, stream=False, return_logprob=False,
                         internal=True,
                         sampling_params=replace(r.sampling_params, max_new_tokens=0))
            for key, r in repeated.items()}


class WaitingCopies:
    """Requests waiting for their prompt's warm-up before being sent."""

    def __init__(self) -> None:
        self._warmup_of: dict[str, str | None] = {}  # rid -> its warm-up's (None: none)
        self._aborted: set[str] = set()  # aborted while waiting: aborted when sent
        self._lora_of: dict[str, str] = {}  # rid -> its LoRA adapter, where it has one

    def __contains__(self, rid: str) -> bool:
        return rid in self._warmup_of

    def uses_adapter(self, lora_name: str) -> bool:
        """Whether a waiting request names this LoRA adapter (an unload waits for it)."""
        return lora_name in self._lora_of.values()

    def wait(self, reqs: list[GenerateRequest],
             warmups: dict[PromptKey, GenerateRequest]) -> None:
        for req in reqs:
            warmup = warmups.get(prompt_key(req))
            self._warmup_of[req.rid] = None if warmup is None else warmup.rid
            if req.lora_name is not None:
                self._lora_of[req.rid] = req.lora_name

    def sent(self, rid: str) -> bool:
        """`rid` is being sent: no longer waiting; whether it was aborted while it waited."""
        self._warmup_of.pop(rid, None)
        self._lora_of.pop(rid, None)
        aborted = rid in self._aborted
        self._aborted.discard(rid)
        return aborted

    def forget(self, reqs: list[GenerateRequest]) -> None:
        """Requests that will not be sent (failed, cancelled)."""
        for req in reqs:
            self.sent(req.rid)

    def abort(self, rid: str) -> str | None:
        """Abort waiting `rid` as soon as it is sent; the rid of its warm-up when no other
        copy needs that any more (the caller aborts it), else None."""
        self._aborted.add(rid)
        warmup = self._warmup_of[rid]
        if warmup is not None and all(other in self._aborted
                                      for other, theirs in self._warmup_of.items()
                                      if theirs == warmup):
            return warmup
        return None
