"""DetokenizerManager: token ids from the scheduler -> text deltas for the TokenizerManager.

Keeps one IncrementalDetokenizer per request id, created on the request's first message and
freed on its finishing message (the scheduler sends exactly one per request, aborts included).
Every message that is not a BatchTokenIDOut is passed through unchanged, in order.

A request whose conversion raises ends alone: it leaves the batch, a ReqError (500) goes to
its consumer, and its later messages are dropped until its finishing one. One request's bad
state must not take the process, and with it the server, down.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import sys
from typing import Any

import zmq

from radixserve.config import ServerArgs
from radixserve.core.io_struct import BatchStrOut, BatchTokenIDOut, ReqError
from radixserve.server.incremental_detokenizer import IncrementalDetokenizer, stop_match
from radixserve.server.ipc import PortArgs, pull_socket, push_socket
from radixserve.server.process_utils import prepare_child_process, report_failure, send_status
from radixserve.server.tokenizer_utils import load_tokenizer
from radixserve.server.cpu_priority import yield_to_compute

logger = logging.getLogger(__name__)


class DetokenizerManager:
    """Pure conversion logic (no sockets), so it can be tested and reused in-process."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, IncrementalDetokenizer] = {}
        self.failed: set[str] = set()  # failed requests whose finishing message is still due
        self.errors: list[ReqError] = []  # for the consumers of requests that just failed

    def handle(self, message: Any) -> Any:
        if isinstance(message, BatchTokenIDOut):
            return self.convert(message)
        return message

    def take_errors(self) -> list[ReqError]:
        errors, self.errors = self.errors, []
        return errors

    def convert(self, batch: BatchTokenIDOut) -> BatchStrOut:
        if self.tokenizer is None:
            return BatchStrOut(rids=list(batch.rids), text_deltas=[""] * len(batch.rids),
                               new_output_ids=list(batch.new_output_ids),
                               finished_reasons=list(batch.finished_reasons),
                               meta_infos=list(batch.meta_infos))
        out = BatchStrOut(rids=[], text_deltas=[], new_output_ids=[], finished_reasons=[],
                          meta_infos=[])
        for i, rid in enumerate(batch.rids):
            finish = batch.finished_reasons[i]
            if rid in self.failed:  # its consumer already has its error
                if finish is not None:
                    self.failed.discard(rid)
                continue
            try:
                delta = self._convert_one(batch, i, rid, finish)
            except Exception:  # noqa: BLE001 - this request ends, the others go on
                logger.exception("request %s: detokenizing failed; the request ends with an "
                                 "error", rid)
                self.states.pop(rid, None)
                if finish is None:
                    self.failed.add(rid)
                self.errors.append(ReqError(
                    rid, "internal error while detokenizing the request (the server log has "
                    "the details)", http_status=500, still_scheduled=finish is None))
                continue
            out.rids.append(rid)
            out.text_deltas.append(delta)
            out.new_output_ids.append(batch.new_output_ids[i])
            out.finished_reasons.append(finish)
            out.meta_infos.append(batch.meta_infos[i])
        return out

    def _convert_one(self, batch: BatchTokenIDOut, i: int, rid: str,
                     finish: dict[str, Any] | None) -> str:
        new_ids = batch.new_output_ids[i]
        state = self.states.get(rid)
        if state is None:
            state = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=batch.skip_special_tokens[i],
                spaces_between_special_tokens=batch.spaces_between_special_tokens[i],
                stop_strs=_at(batch.stop_strs, i, []),
                keep_special_tokens=_at(batch.keep_special_tokens, i, ()),
                include_stop=_at(batch.include_stop, i, False))
            self.states[rid] = state
        if finish is None:
            return state.append(new_ids)
        del self.states[rid]
        return state.finish(new_ids, stop_match(finish))


def _at(values: list[Any], i: int, default: Any) -> Any:
    return values[i] if i < len(values) else default


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs,
                            status_conn: multiprocessing.connection.Connection) -> None:
    """Entry point of the detokenizer child (spawned)."""
    prepare_child_process("detokenizer", server_args.log_level)
    yield_to_compute(server_args, "detokenizer")
    context = zmq.Context(1)
    try:
        manager = DetokenizerManager(load_tokenizer(server_args))
        recv_sock = pull_socket(context, port_args.detokenizer_input)
        send_sock = push_socket(context, port_args.tokenizer_input)
        send_status(status_conn, {"status": "ready"})
        while True:
            send_sock.send_pyobj(manager.handle(recv_sock.recv_pyobj()))
            for error in manager.take_errors():
                send_sock.send_pyobj(error)
    except SystemExit:
        raise
    except BaseException:
        report_failure(status_conn, "detokenizer")
        sys.exit(1)
    finally:
        context.destroy(linger=0)
