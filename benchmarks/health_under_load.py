"""/health latency while the server tokenises a huge prompt (the event loop must stay free).

    python benchmarks/health_under_load.py [--prompt-mb 20] [-- server flags...]

Starts the real server on the bundled model, posts one prompt of --prompt-mb megabytes of text
to /generate from a thread (it is tokenised, then refused for its length), and polls /health
meanwhile; prints the number of polls during the big request, their median and max latency, and
how long the big request took.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server.server_process import ServerProcess  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-mb", type=float, default=20.0)
    args, server_flags = parser.parse_known_args()
    server = ServerProcess(*[f for f in server_flags if f != "--"])
    try:
        text = "hello world, " * int(args.prompt_mb * 1e6 / 13)
        done = threading.Event()
        big: dict = {}

        def post() -> None:
            start = time.perf_counter()
            response = requests.post(server.url("/generate"), timeout=600,
                                     json={"text": text, "sampling_params": {"max_new_tokens": 1}})
            big.update(status=response.status_code, seconds=time.perf_counter() - start)
            done.set()

        thread = threading.Thread(target=post)
        thread.start()
        latencies = []
        while not done.is_set():
            start = time.perf_counter()
            requests.get(server.url("/health"), timeout=60).raise_for_status()
            if not done.is_set():
                latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
        thread.join()
        print(f"big request: {args.prompt_mb:.0f} MB of text, status {big['status']}, "
              f"{big['seconds']:.1f} s")
        print(f"/health during it: {len(latencies)} polls, median "
              f"{statistics.median(latencies) * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
