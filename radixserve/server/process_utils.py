"""Helpers for the server's child processes: parent-death watch, signals, error reports.

A child reports to the parent through a one-way pipe: {"status": "ready", ...} once started, or
{"status": "error", "traceback": ...} when it fails ("message" instead, for an error meant for
the operator, such as ranks started unlike each other); then it exits non-zero. A child never
outlives the parent: a thread waits on the parent's sentinel and ends the child when it fires.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import traceback
from typing import Any, Callable

logger = logging.getLogger(__name__)
_sigterm_watched = False  # terminate_only_from_parent ran in this process
# what the parent's SIGTERM does instead of ending the process at once (`on_parent_stop`)
_parent_stop: Callable[[], None] | None = None
# how long a process with a stop handler has, after the parent's SIGTERM, to end by itself
STOP_GRACE_S = 10.0


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
    terminates the children, so children ignore SIGINT. SIGTERM is the parent's "stop now"
    (`terminate_only_from_parent`); a SIGTERM to the whole group (systemd's stop, `kill --
    -PGID`) reaches the parent too, which drains the requests in flight and then stops the
    children itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    terminate_only_from_parent()
    configure_logging(log_level, process_name)
    exit_when_parent_dies()


def terminate_only_from_parent() -> None:
    """A SIGTERM the parent sent ends this process at once, as the default action does; one
    from anyone else is logged and ignored. SIGTERM is blocked in this thread (before any other
    starts, so in all of them) and taken by a thread of its own with sigwaitinfo, which names
    the sender: a Python handler could not (and would run only once the main thread came back
    from a blocking ZMQ call). Where sigwaitinfo is missing, SIGTERM keeps its default. Called
    first thing in a child, before its imports start threads of their own."""
    global _sigterm_watched
    if _sigterm_watched:  # once per process: a child released by the server calls it twice
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent = os.getppid()
    if not hasattr(signal, "sigwaitinfo") or parent <= 1:
        return
    _sigterm_watched = True
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        stopping = False
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid != parent:
                logger.info("ignoring SIGTERM from pid %d: the server's main process stops "
                            "this one after draining its requests", info.si_pid)
                continue
            handler = _parent_stop
            if handler is None or stopping:
                _end_by_sigterm()
            stopping = True
            handler()
            deadline = threading.Timer(STOP_GRACE_S, _end_by_sigterm)
            deadline.daemon = True  # (a process that ends by itself does not wait for it)
            deadline.start()

    threading.Thread(target=wait, name="sigterm-from-parent", daemon=True).start()


def _end_by_sigterm() -> None:
    """SIGTERM's default action, from the calling thread (SIGTERM is unblocked in it only)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.raise_signal(signal.SIGTERM)


def on_parent_stop(handler: Callable[[], None]) -> None:
    """The parent's SIGTERM calls `handler` (from the signal thread) instead of ending this
    process at once: the process is to end by itself, and is ended STOP_GRACE_S later (or at
    a second SIGTERM) if it has not."""
    global _parent_stop
    _parent_stop = handler


def report_failure(conn: multiprocessing.connection.Connection, process_name: str) -> None:
    """Send the current exception's traceback to the parent (best effort) and log it; an
    exception meant for the operator (`show_traceback = False`) goes as its message alone."""
    exc = sys.exc_info()[1]
    if exc is not None and not getattr(exc, "show_traceback", True):
        logger.error("%s process failed: %s", process_name, exc)
        send_status(conn, {"status": "error", "process": process_name, "message": str(exc)})
        return
    text = traceback.format_exc()
    logger.error("%s process failed:\n%s", process_name, text)
    send_status(conn, {"status": "error", "process": process_name, "traceback": text})


def failure_detail(message: dict[str, Any] | None) -> str:
    """What a child's error status adds to "the X process failed": ": its message" for an
    operator's error, else its traceback on the lines below ('' without an error status)."""
    if not message or message.get("status") != "error":
        return ""
    if message.get("message"):
        return f": {message['message']}"
    return f":\n{message.get('traceback', '')}"


def send_status(conn: multiprocessing.connection.Connection, message: dict[str, Any]) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass
