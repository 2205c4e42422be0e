"""The server's side of runtime LoRA updates (server/lora_control.py) over two data-parallel
replicas whose answers are scripted: a load reaches both or neither (a replica that loaded it
unloads it again when the other could not, or when the answers did not come in time), and an
unload reaches both or neither (a replica that unloaded it loads it again from its folder)."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from radixserve.core.io_struct import LoadLoRAReq, LoRAUpdateReply, UnloadLoRAReq
from radixserve.core.request_validation import RequestLimits
from radixserve.server.errors import APIError
from radixserve.server.lora_control import LoRAControl
from radixserve.server.shared_prefix import WaitingCopies


class Replicas:
    """The tokenizer manager's side a LoRAControl uses, with scripted replica answers."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers  # per call: a list of (success, message), or an APIError
        self.sent: list[Any] = []
        self.limits = RequestLimits(64, 50, lora_names=("base_adapter",))
        self.model_info = {"lora_paths": {"base_adapter": "/adapters/base"}}
        self.waiting, self.rid_to_state = WaitingCopies(), {}

    async def _request_replies(self, message: Any, reply_type: type) -> list[Any]:
        self.sent.append(message)
        answer = self.answers.pop(0) if self.answers else [(True, "ok")] * 2
        if isinstance(answer, APIError):
            raise answer
        return [LoRAUpdateReply(ok, text, rank) for rank, (ok, text) in enumerate(answer)]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_load_one_replica_refuses_is_undone_on_the_other() -> None:
    tm = Replicas([[(True, "loaded"), (False, "all 1 LoRA slots are taken")]])
    control = LoRAControl(tm)
    with pytest.raises(APIError, match="slots are taken"):
        _run(control.load("x", "/adapters/x"))
    assert tm.sent == [LoadLoRAReq("x", "/adapters/x"), UnloadLoRAReq("x")]
    assert tm.limits.lora_names == ("base_adapter",) and "x" not in control.paths


def test_a_load_without_answers_in_time_is_undone() -> None:
    tm = Replicas([APIError("no answer in time", status_code=503)])
    with pytest.raises(APIError, match="in time"):
        _run(LoRAControl(tm).load("x", "/adapters/x"))
    assert tm.sent[-1] == UnloadLoRAReq("x") and tm.limits.lora_names == ("base_adapter",)


def test_an_unload_one_replica_refuses_is_undone_from_the_adapters_folder() -> None:
    tm = Replicas([[(True, "unloaded"), (False, "no LoRA adapter named 'base_adapter'")]])
    control = LoRAControl(tm)
    with pytest.raises(APIError) as info:
        _run(control.unload("base_adapter"))
    assert info.value.status_code == 409
    assert tm.sent == [UnloadLoRAReq("base_adapter"),
                       LoadLoRAReq("base_adapter", "/adapters/base")]
    assert tm.limits.lora_names == ("base_adapter",)


def test_loads_and_unloads_that_succeed_update_the_names() -> None:
    tm = Replicas([])
    control = LoRAControl(tm)
    _run(control.load("x", "/adapters/x"))
    assert tm.limits.lora_names == ("base_adapter", "x") and control.paths["x"] == "/adapters/x"
    _run(control.unload("x"))
    assert tm.limits.lora_names == ("base_adapter",) and "x" not in control.paths
    tm.limits = replace(tm.limits, lora_names=())
    with pytest.raises(APIError) as info:
        _run(control.unload("x"))
    assert info.value.status_code == 404
