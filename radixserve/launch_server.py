"""`python -m radixserve.launch_server [--model-path ...] [--port ...]`: start the HTTP server.

Flags are ServerArgs' fields, SGLang style (see `--help`). With no --model-path it serves the
bundled SmolLM2-135M-Instruct on the CPU. Same as `radixserve serve`.
"""
from __future__ import annotations

import sys

if __name__ == "__main__":
    from radixserve.server.launch import main

    sys.exit(main())
