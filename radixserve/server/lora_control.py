"""LoRA adapters loaded and unloaded at run time, the server's side (POST /load_lora_adapter and
/unload_lora_adapter, with vLLM's /v1/ aliases): each data-parallel replica's scheduler fills or
frees a slot (scheduler/lora_updates.py), and the tokenizer manager's limits, which every new
request is checked against, name the adapters served.

A load reaches every replica or none (one that loaded it unloads it again when another could
not, or when the answers did not come in time). An unload first stops taking the adapter's
requests, then waits for those in flight to finish (and for copies of an n > 1 request still
waiting to be sent), then frees the slots, on every replica or none (one that unloaded it
loads it again from its folder). One update at a time.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.requests import Request

from radixserve.core.io_struct import LoadLoRAReq, LoRAUpdateReply, UnloadLoRAReq
from radixserve.server.errors import APIError
from radixserve.server.http_utils import read_json

if TYPE_CHECKING:
    from radixserve.server.tokenizer_manager import TokenizerManager

DRAIN_POLL_S = 0.02  # how often an unload looks whether the adapter's requests have finished


class LoRAControl:
    def __init__(self, tm: "TokenizerManager") -> None:
        self.tm = tm
        self._lock: asyncio.Lock | None = None  # made in the event loop
        # each loaded adapter's folder: a failed unload loads it again where it went
        self.paths: dict[str, str] = dict(tm.model_info.get("lora_paths") or {})

    def _set_names(self, names: tuple[str, ...]) -> None:
        self.tm.limits = dataclasses.replace(self.tm.limits, lora_names=names)

    async def load(self, name: str, path: str) -> str:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            names = self.tm.limits.lora_names
            if name in names:
                raise APIError(f"a LoRA adapter named {name!r} is loaded already",
                               param="lora_name")
            try:
                replies = await self.tm._request_replies(LoadLoRAReq(name, path),
                                                         LoRAUpdateReply)
            except APIError:  # no answer in time: a replica may still load it, so it unloads
                await self._best_effort(UnloadLoRAReq(name))
                raise
            failed = [reply for reply in replies if not reply.success]
            if failed:
                if len(failed) < len(replies):  # all or none: the others unload it again
                    await self._best_effort(UnloadLoRAReq(name))
                raise APIError(failed[0].message, param="lora_path")
            self._set_names((*names, name))
            self.paths[name] = path
            return replies[0].message

    async def _best_effort(self, message: object) -> None:
        """Send `message` to every replica; answers (refusals, a timeout) do not matter."""
        try:
            await self.tm._request_replies(message, LoRAUpdateReply)
        except APIError:
            pass

    async def unload(self, name: str) -> str:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            names = self.tm.limits.lora_names
            if name not in names:
                raise APIError(f"no LoRA adapter named {name!r} is loaded", status_code=404,
                               param="lora_name")
            self._set_names(tuple(n for n in names if n != name))  # no new requests of it
            while self.tm.waiting.uses_adapter(name) or any(
                    state.req.lora_name == name and not state.finished
                    for state in self.tm.rid_to_state.values()):
                await asyncio.sleep(DRAIN_POLL_S)
            replies = await self.tm._request_replies(UnloadLoRAReq(name), LoRAUpdateReply)
            failed = [reply for reply in replies if not reply.success]
            if failed:  # all or none: the replicas that unloaded it load it again
                if len(failed) < len(replies) and name in self.paths:
                    await self._best_effort(LoadLoRAReq(name, self.paths[name]))
                self._set_names(self.tm.limits.lora_names + (name,))
                raise APIError(failed[0].message, status_code=409, param="lora_name")
            self.paths.pop(name, None)
            return replies[0].message


def _field(body: object, key: str) -> str:
    value = body.get(key) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise APIError(f"give {key!r} as a non-empty string", param=key)
    return value


def lora_router(tm: "TokenizerManager") -> APIRouter:
    """POST /load_lora_adapter {"lora_name", "lora_path"} and /unload_lora_adapter
    {"lora_name"} (SGLang's), also under /v1/ (vLLM's): {"success", "message",
    "loaded_adapters"}, or an error (400; 404 for an unknown name, 409 for one still in use)."""
    router = APIRouter()
    control = LoRAControl(tm)

    def answer(message: str) -> JSONResponse:
        return JSONResponse({"success": True, "message": message,
                             "loaded_adapters": list(tm.limits.lora_names)})

    async def load(request: Request) -> JSONResponse:
        body = await read_json(request)
        return answer(await control.load(_field(body, "lora_name"), _field(body, "lora_path")))

    async def unload(request: Request) -> JSONResponse:
        return answer(await control.unload(_field(await read_json(request), "lora_name")))

    for prefix in ("", "/v1"):
        router.add_api_route(prefix + "/load_lora_adapter", load, methods=["POST"])
        router.add_api_route(prefix + "/unload_lora_adapter", unload, methods=["POST"])
    return router
