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
        began = time.perf_counter()
        thread.start()
        latencies, slow_at = [], []
        while not done.is_set():
            start = time.perf_counter()
            requests.get(server.url("/health"), timeout=60).raise_for_status()
            if not done.is_set():
                latencies.append(time.perf_counter() - start)
                if latencies[-1] > 0.1:
                    slow_at.append(start - began)
            time.sleep(0.02)
        thread.join()
        print(f"big request: {args.prompt_mb:.0f} MB of text, status {big['status']}, "
              f"{big['seconds']:.1f} s")
        ordered = sorted(latencies)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        slow = sum(t > 0.1 for t in latencies)
        print(f"/health during it: {len(latencies)} polls, median "
              f"{statistics.median(latencies) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max "
              f"{max(latencies) * 1e3:.1f} ms, {slow} over 100 ms (sent at "
              f"{', '.join(f'{t:.2f}' for t in slow_at) or '-'} s into the big request)")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
