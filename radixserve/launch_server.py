"""`python -m radixserve.launch_server [--model-path ...] [--port ...]`: start the HTTP server.

Flags are ServerArgs' fields, SGLang style (see `--help`). With no --model-path it serves the
bundled SmolLM2-135M-Instruct on the CPU.
"""
from __future__ import annotations

import argparse

from radixserve.config import ServerArgs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m radixserve.launch_server",
                                     description="radixserve HTTP server")
    ServerArgs.add_cli_args(parser)
    server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
    from radixserve.server.launch import launch_server

    launch_server(server_args)


if __name__ == "__main__":
    main()
