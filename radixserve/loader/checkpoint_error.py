"""CheckpointError: a checkpoint that cannot be loaded as it is (a missing or extra tensor, a
missing or unreadable file). A ValueError, so every front end that reports a bad model in one
line (the server's start, the CLI) does so; its message alone reaches the operator, without a
traceback, when a server child raises it (server/process_utils.report_failure)."""
from __future__ import annotations


class CheckpointError(ValueError):
    show_traceback = False
