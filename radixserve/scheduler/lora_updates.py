"""LoRA adapters loaded and unloaded while the scheduler serves (POST /load_lora_adapter,
Engine.load_lora_adapter): the runner's LoRAManager fills or frees a slot, and the scheduler's
request limits name the adapters requests may ask for from then on.

An adapter is unloaded only once no request of it is queued, running or in flight (the server
stops taking its requests first and waits for them); its cached prefixes stay in the radix
cache under its old key until evicted, and an adapter loaded later under the same name gets a
new key (`lora_cache_id`), so it never reads the old one's KV.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from radixserve.core.io_struct import LoRAUpdateReply

if TYPE_CHECKING:
    from radixserve.core.req import Req
    from radixserve.core.request_validation import RequestLimits

NOT_ENABLED = ("LoRA is not enabled: start with --max-loras N --max-lora-rank R (or "
               "--lora-paths) to load adapters")


class LoRAUpdatesMixin:
    runner: Any
    limits: "RequestLimits"
    waiting_queue: list["Req"]
    chunked_req: "Req | None"

    if TYPE_CHECKING:
        def _settle(self) -> None: ...
        def admitted_reqs(self) -> list["Req"]: ...

    def lora_cache_id(self, name: str | None) -> str | None:
        """The name a request of adapter `name` keys its cached prefixes by."""
        lora = getattr(self.runner, "lora", None)
        if name is None or lora is None:
            return name
        return lora.cache_ids.get(name, name)

    def _note_loaded_adapters(self, lora: Any) -> None:
        """Requests may name the adapters the runner's slots hold, in their load order."""
        self.limits = dataclasses.replace(self.limits, lora_names=tuple(lora.slots))

    def load_lora(self, name: str, path: str) -> LoRAUpdateReply:
        from radixserve.executor.lora_manager import LoRALoadError
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            return LoRAUpdateReply(False, NOT_ENABLED)
        try:
            lora.load(name, path)
        except LoRALoadError as exc:
            return LoRAUpdateReply(False, str(exc))
        self._note_loaded_adapters(lora)
        return LoRAUpdateReply(True, f"LoRA adapter {name!r} loaded")

    def unload_lora(self, name: str) -> LoRAUpdateReply:
        from radixserve.executor.lora_manager import LoRALoadError
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            return LoRAUpdateReply(False, NOT_ENABLED)
        self._settle()  # the step in flight's requests are finished or still running
        queued = self.waiting_queue + ([self.chunked_req] if self.chunked_req else [])
        users = sum(req.lora_name == name for req in queued + self.admitted_reqs())
        if users:
            return LoRAUpdateReply(False, f"LoRA adapter {name!r} still has {users} requests; "
                                          "unload it once they finish")
        try:
            lora.unload(name)
        except LoRALoadError as exc:
            return LoRAUpdateReply(False, str(exc))
        self._note_loaded_adapters(lora)
        return LoRAUpdateReply(True, f"LoRA adapter {name!r} unloaded")
