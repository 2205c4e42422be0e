"""DetokenizerManager: token ids from the scheduler -> text deltas for the TokenizerManager.

Keeps one IncrementalDetokenizer per request id, created on the request's first message and
freed on its finishing message (the scheduler sends exactly one per request, aborts included).
Every message that is not a BatchTokenIDOut is passed through unchanged, in order.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import sys
from typing import Any

import zmq

from radixserve.config import ServerArgs
from radixserve.core.io_struct import BatchStrOut, BatchTokenIDOut
from radixserve.server.incremental_detokenizer import IncrementalDetokenizer
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

    def handle(self, message: Any) -> Any:
        if isinstance(message, BatchTokenIDOut):
            return self.convert(message)
        return message

    def convert(self, batch: BatchTokenIDOut) -> BatchStrOut:
        deltas: list[str] = []
        for i, rid in enumerate(batch.rids):
            new_ids = batch.new_output_ids[i]
            finish = batch.finished_reasons[i]
            if self.tokenizer is None:
                deltas.append("")
                continue
            state = self.states.get(rid)
            if state is None:
                stop_strs = _at(batch.stop_strs, i, [])
                state = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=batch.skip_special_tokens[i],
                    spaces_between_special_tokens=batch.spaces_between_special_tokens[i],
                    stop_strs=stop_strs,
                    keep_special_tokens=_at(batch.keep_special_tokens, i, ()))
                self.states[rid] = state
            if finish is None:
                deltas.append(state.append(new_ids))
            else:
                deltas.append(state.finish(new_ids, _matched_stop_str(finish)))
                del self.states[rid]
        return BatchStrOut(rids=list(batch.rids), text_deltas=deltas,
                           new_output_ids=list(batch.new_output_ids),
                           finished_reasons=list(batch.finished_reasons),
                           meta_infos=list(batch.meta_infos))


def _at(values: list[Any], i: int, default: Any) -> Any:
    return values[i] if i < len(values) else default


def _matched_stop_str(finish_reason: dict[str, Any]) -> str | None:
    matched = finish_reason.get("matched")
    if finish_reason.get("type") == "stop" and isinstance(matched, str):
        return matched
    return None


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
    except SystemExit:
        raise
    except BaseException:
        report_failure(status_conn, "detokenizer")
        sys.exit(1)
    finally:
        context.destroy(linger=0)
