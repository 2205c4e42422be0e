"""Takes the server down when one scheduler turn hangs.

A turn that never ends (a tensor-parallel rank stopped or unreachable, so a collective waits;
a wedged device) would leave every request waiting with no end, and /health answering 200. The
watchdog thread checks the turn in progress every second; past --watchdog-timeout seconds it
logs the scheduler thread's stack and ends the process with status 1, which the server's main
process sees as a dead child: open requests end with an error and the server exits (SGLang's
--watchdog-timeout does the same, 300 s by default)."""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)
CHECK_EVERY_S = 1.0


def _exit_hung(seconds: float) -> None:
    logger.error("a scheduler turn has run for %.0f s, past --watchdog-timeout: a rank or the "
                 "device is hung; taking the server down. The scheduler's stack:", seconds)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(1)


class TurnWatchdog:
    """`turn_started()` / `turn_ended()` around each turn; `on_hang(seconds)` runs once when a
    turn passes `timeout_s` (0: never)."""

    def __init__(self, timeout_s: float,
                 on_hang: Callable[[float], None] = _exit_hung) -> None:
        self.timeout_s = timeout_s
        self.on_hang = on_hang
        self._started_at: float | None = None
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="turn-watchdog", daemon=True).start()

    def turn_started(self) -> None:
        self._started_at = time.monotonic()

    def turn_ended(self) -> None:
        self._started_at = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(CHECK_EVERY_S, self.timeout_s / 4))
            started = self._started_at
            if started is not None and time.monotonic() - started > self.timeout_s:
                self.on_hang(time.monotonic() - started)
                return
