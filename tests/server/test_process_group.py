"""A server child's two-step start (process_group._run_when_released): it imports while the
server checks, runs its entry only once released, and exits quietly, without running it, when
the server closes its pipe instead."""
from __future__ import annotations

import multiprocessing
from pathlib import Path

from radixserve.server.process_group import _run_when_released


def write_marker(path: str) -> None:
    Path(path).write_text("ran")


def _spawn(tmp_path: Path, preload: tuple[str, ...] = ("json",)):
    ctx = multiprocessing.get_context("spawn")
    release_recv, release_send = ctx.Pipe(duplex=False)
    marker = tmp_path / "marker"
    process = ctx.Process(target=_run_when_released,
                          args=(release_recv, preload, write_marker, (str(marker),)))
    process.start()
    release_recv.close()
    return process, release_send, marker


def test_a_released_child_runs_its_entry(tmp_path: Path) -> None:
    process, release, marker = _spawn(tmp_path)
    release.send(True)
    release.close()
    process.join(timeout=60)
    assert process.exitcode == 0 and marker.read_text() == "ran"


def test_a_child_whose_pipe_closes_exits_without_running(tmp_path: Path) -> None:
    process, release, marker = _spawn(tmp_path)
    release.close()  # a failed check: ProcessGroup.shutdown() before release()
    process.join(timeout=60)
    assert process.exitcode == 0 and not marker.exists()


def test_a_failing_preload_is_left_to_the_entry(tmp_path: Path) -> None:
    process, release, marker = _spawn(tmp_path, preload=("radixserve_no_such_module", "json"))
    release.send(True)
    release.close()
    process.join(timeout=60)
    assert process.exitcode == 0 and marker.read_text() == "ran"
