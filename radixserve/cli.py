"""`radixserve serve | generate | bench ...` (also `python -m radixserve`)."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from radixserve.config import ServerArgs

BENCH_MODULES = {"serving": "radixserve.bench.serving", "offline": "radixserve.bench.offline",
                 "one-batch": "radixserve.bench.one_batch", "plot": "radixserve.bench.plot"}


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="radixserve generate",
                                     description="Generate text offline and print it.")
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message with the chat template")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="[%(asctime)s] %(message)s")
    from radixserve.engine import Engine
    server_args = ServerArgs.from_cli_args(args)
    engine = Engine(**{k: v for k, v in vars(server_args).items() if k != "resolved"})
    prompt = args.prompt
    if args.chat:
        assert engine.tokenizer is not None
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "top_p": args.top_p}
    for chunk in engine.generate_stream(prompt, params):
        print(chunk["text"], end="", flush=True)
    print()
    return 0


def _serve(argv: list[str]) -> int:
    from radixserve.server.launch import main as serve_main
    return serve_main(argv) or 0


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCH_MODULES:
        print(f"usage: radixserve bench {{{'|'.join(BENCH_MODULES)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCH_MODULES[argv[0]])
    return module.main(argv[1:]) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": _serve, "generate": _generate, "bench": _bench}
    if not argv or argv[0] not in commands:
        print("usage: radixserve {serve|generate|bench} [options]", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
