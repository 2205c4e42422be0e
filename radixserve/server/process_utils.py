"""Helpers for the server's child processes: parent-death watch, signals, error reports.

A child reports to the parent through a one-way pipe: {"status": "ready", ...} once started, or
{"status": "error", "traceback": ...} when it fails; then it exits non-zero. A child never
outlives the parent: a thread waits on the parent's sentinel and ends the child when it fires.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import traceback
from typing import Any

logger = logging.getLogger(__name__)


def configure_logging(log_level: str, process_name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format=f"%(asctime)s [{process_name}] %(levelname)s %(name)s: %(message)s",
        force=True)


def exit_when_parent_dies() -> None:
    """Start a daemon thread that hard-exits this process once its parent process is gone."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def prepare_child_process(process_name: str, log_level: str) -> None:
    """Common set-up at the top of every child's entry function.

    Ctrl-C in a terminal reaches the whole process group; only the parent acts on it and then
    terminates the children, so children ignore SIGINT. SIGTERM is the parent's "stop now" and
    keeps the default action: a Python-level handler would only run once the main thread comes
    back from a blocking ZMQ call, which a signal delivered to another thread does not cause."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    configure_logging(log_level, process_name)
    exit_when_parent_dies()


def report_failure(conn: multiprocessing.connection.Connection, process_name: str) -> None:
    """Send the current exception's traceback to the parent (best effort) and log it."""
    text = traceback.format_exc()
    logger.error("%s process failed:\n%s", process_name, text)
    send_status(conn, {"status": "error", "process": process_name, "traceback": text})


def send_status(conn: multiprocessing.connection.Connection, message: dict[str, Any]) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass
