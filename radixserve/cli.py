"""`radixserve serve | generate | bench ...` (also `python -m radixserve`).

Flags are parsed before anything heavy is imported, so `--help` answers at once."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from radixserve.config import ServerArgs
from radixserve.core.server_flags import OFFLINE_GROUPS

BENCH_MODULES = {"serving": "radixserve.bench.serving", "offline": "radixserve.bench.offline",
                 "one-batch": "radixserve.bench.one_batch", "plot": "radixserve.bench.plot",
                 "hardware": "radixserve.bench.hardware"}
BENCH_SUMMARIES = {
    "serving": "a running server under load: throughput, TTFT, TPOT, ITL, E2E",
    "offline": "the in-process Engine on a whole workload, radix cache on or off",
    "one-batch": "one static batch through the model runner, against the roofline",
    "plot": "throughput-vs-latency curves from `bench serving` JSON lines",
    "hardware": "this machine's memory bandwidth and matmul peak, and a model's limits",
}


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="radixserve generate",
                                     description="Generate text offline and print it.")
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="tokens to generate at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling's probability mass (default 1.0)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message with the chat template")
    ServerArgs.add_cli_args(parser, OFFLINE_GROUPS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="[%(asctime)s] %(message)s")
    from radixserve.core.sampling_params import InvalidRequestError, SamplingParams
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "top_p": args.top_p}
    try:  # the user's mistakes as one line each, the sampling ones before the model loads
        SamplingParams.from_dict(params).verify()
        if not args.prompt:
            raise InvalidRequestError("the prompt must not be empty")
        server_args = ServerArgs.from_cli_args(args)
        from radixserve.engine import Engine
        engine = Engine(**{k: v for k, v in vars(server_args).items() if k != "resolved"})
    except (InvalidRequestError, ValueError, FileNotFoundError) as exc:
        print(f"radixserve generate: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.chat:  # the template writes the special tokens, as the chat route's prompt
            if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
                raise InvalidRequestError("--chat needs a tokenizer with a chat template")
            ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}], tokenize=False,
                add_generation_prompt=True), add_special_tokens=False)
            chunks = engine.generate_stream(input_ids=ids, sampling_params=params)
        else:
            chunks = engine.generate_stream(args.prompt, params)
        for chunk in chunks:
            print(chunk["text"], end="", flush=True)
        print()
    except InvalidRequestError as exc:
        print(f"radixserve generate: error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    return 0


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve serve", description="Serve a model over HTTP: the native API "
        "(/generate) and the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models).")
    ServerArgs.add_cli_args(parser)
    return parser


def _serve(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)  # --help ends here, before the server imports
    from radixserve.server.launch import serve
    return serve(ServerArgs.from_cli_args(args))


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCH_MODULES:
        usage = f"usage: radixserve bench {{{'|'.join(BENCH_MODULES)}}} [options]\n\n" \
            "benchmarks (radixserve bench NAME --help):\n" + "\n".join(
                f"  {name:<10} {text}" for name, text in BENCH_SUMMARIES.items())
        if argv and argv[0] in ("-h", "--help"):
            print(usage)
            return 0
        print(usage, file=sys.stderr)
        return 2
    module = importlib.import_module(BENCH_MODULES[argv[0]])
    return module.main(argv[1:]) or 0


COMMANDS = {
    "serve": "serve a model over HTTP (native and OpenAI APIs)",
    "generate": "generate text for one prompt, offline, and print it as it comes",
    "bench": f"benchmarks: {', '.join(BENCH_MODULES)} (radixserve bench NAME --help)",
}
USAGE = "usage: radixserve {serve|generate|bench} [options]\n\ncommands:\n" + "\n".join(
    f"  {name:<9} {text}" for name, text in COMMANDS.items()) + \
    "\n\n`radixserve COMMAND --help` lists a command's options."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": _serve, "generate": _generate, "bench": _bench}
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in commands:
        print(USAGE, file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
