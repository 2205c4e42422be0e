"""Start the real server (`python -m radixserve.launch_server`) as a subprocess for e2e tests."""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0  # a hang guard, not a performance assertion


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, attempts: int = 100) -> bool:
    """True once `pid` has exited (polls for up to ~10 s)."""
    for _ in range(attempts):
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


class ServerProcess:
    def __init__(self, *extra_args: str, api_key: str | None = None,
                 own_process_group: bool = False) -> None:
        """`own_process_group`: the server leads a process group of its own (its pid is the
        group's id), so a test can signal the whole group without reaching pytest."""
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "radixserve.launch_server", "--port", str(self.port),
                *extra_args]
        if api_key:
            args += ["--api-key", api_key]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
        self.log = tempfile.NamedTemporaryFile("w+", prefix="radixserve-test-", suffix=".log",
                                               delete=False)
        # kept while the tests run (they read it after the server stops), removed at exit
        atexit.register(Path(self.log.name).unlink, missing_ok=True)
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT,
                                     start_new_session=own_process_group)
        self._wait_ready()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_text()[-5000:]}")
            try:
                if requests.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not become ready:\n{self.log_text()[-5000:]}")

    def server_info(self) -> dict:
        response = requests.get(self.url("/get_server_info"), headers=self.headers, timeout=60)
        response.raise_for_status()
        return response.json()

    def wait_idle_memory_check(self, attempts: int = 120) -> dict:
        """Poll until the scheduler is idle and ran its memory check; return the last info."""
        info: dict = {}
        for _ in range(attempts):
            info = self.server_info()
            if info["internal_state"]["memory_check_ok"] is not None \
                    and info["num_in_flight_requests"] == 0:
                return info
            time.sleep(0.5)
        return info

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
