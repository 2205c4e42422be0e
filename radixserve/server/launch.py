"""launch_server: start the child processes, the HTTP server, warm up, and shut down cleanly.

Start-up order: the port bound and the model path resolved (fail fast) -> scheduler +
detokenizer children (spawned; they import while the config is checked) -> wait until the
model is loaded -> tokenizer and TokenizerManager -> uvicorn -> a warm-up /generate through
HTTP -> /health turns 200 and "ready" is logged. If any child dies, or the warm-up fails, the
server exits non-zero; SIGINT/SIGTERM stop it cleanly (exit 0). Children never outlive the
server.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import uvicorn

from radixserve.config import DEFAULT_MODEL_NAME, ServerArgs
from radixserve.server.scheduler_process import SchedulerFactory
from radixserve.server.cpu_priority import bound_matmul_caches
from radixserve.server.dp_router import DataParallelRouter
from radixserve.server.http_server import build_app
from radixserve.server.ipc import PortArgs
from radixserve.server.metrics import ServerMetrics
from radixserve.server.native_api import WARM_UP_HEADER
from radixserve.server.process_group import ChildFailedError, ProcessGroup
from radixserve.server.process_utils import configure_logging
from radixserve.server.tokenizer_manager import TokenizerManager
from radixserve.server.image_inputs import ImageOptions
from radixserve.server.tokenizer_utils import load_tokenizer
from radixserve.server.tp_follower_process import run_headless_node
from radixserve.server.cpu_priority import yield_to_compute

logger = logging.getLogger("radixserve.server")

WARMUP_TIMEOUT_S = 600.0
FORCED_EXIT_DELAY_S = 15.0


class ShutdownRequested(Exception):
    """SIGINT or SIGTERM arrived outside uvicorn's own handling."""


def served_model_name(server_args: ServerArgs, model_name: str) -> str:
    """--served-model-name, else the resolved model's name (`model_name`: a hub repo's id, a
    folder's or .gguf file's name)."""
    return server_args.served_model_name or model_name


def accepted_model_names(server_args: ServerArgs, model_name: str) -> frozenset[str]:
    """The `model` values requests may name: --served-model-name alone where given (as vLLM
    accepts only the served names), else the model's name and the model path as given."""
    name = served_model_name(server_args, model_name)
    if server_args.served_model_name:
        return frozenset({name})
    return frozenset({name, server_args.model_path or DEFAULT_MODEL_NAME})


class GracefulServer(uvicorn.Server):
    """uvicorn, with a shutdown that first stops admitting requests, lets the running ones
    finish for up to --shutdown-timeout seconds, then ends the rest with an error event (so
    clients see why their stream ended) before uvicorn closes the connections. Its summary
    counts the requests a server failure ended before the shutdown too
    (`TokenizerManager.ended_by_failure`)."""

    def __init__(self, config: uvicorn.Config, tm: TokenizerManager, drain_s: float) -> None:
        super().__init__(config)
        self.tm, self.drain_s = tm, drain_s

    async def shutdown(self, sockets: Any = None) -> None:
        tm = self.tm
        if tm.refusing is None:
            tm.refusing = "the server is shutting down"
        started = time.monotonic()
        deadline = started + self.drain_s
        while tm.rid_to_state and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        drained = time.monotonic() - started
        ended_now = tm.fail_all(tm.refusing)
        if ended_now:
            await asyncio.sleep(0.2)  # let the handlers write their final events
        logger.info("shutting down: %d request(s) ended with an error%s after %.1f s of drain "
                    "(at most %.1f s)", tm.ended_by_failure + ended_now,
                    _failure_share(tm.ended_by_failure), drained, self.drain_s)
        await super().shutdown(sockets)


def _failure_share(ended_by_failure: int) -> str:
    """The part of the shutdown summary that the server's failure ended, when there is one."""
    return f" ({ended_by_failure} when the server failed)" if ended_by_failure else ""


def one_line_failure(message: str) -> str:
    """A child's failure for clients, in one line: its first line and, where a traceback
    follows, the exception it ends with (not "the scheduler process died (exit code 1):"
    alone)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else message
    return f"{lines[0].rstrip(':')}: {lines[-1]}"


@dataclasses.dataclass
class ServerState:
    exit_code: int = 0
    ready: bool = False
    server: GracefulServer | None = None
    tm: TokenizerManager | None = None
    model_name: str = DEFAULT_MODEL_NAME  # what the API serves

    def fail(self, message: str) -> None:
        logger.error("%s", message)
        self.exit_code = 1
        failure = "the server failed: " + one_line_failure(message)
        if self.tm is not None:  # every open request fails now, not after a timeout
            self.tm.fail_all_threadsafe(failure)
        if self.server is not None:
            self.server.should_exit = True
        # last resort if the graceful stop hangs (children end themselves when we are gone)
        timer = threading.Timer(FORCED_EXIT_DELAY_S, os._exit, args=(1,))
        timer.daemon = True
        timer.start()


def _raise_shutdown(signum: int, _frame: Any) -> None:
    raise ShutdownRequested(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """`radixserve serve` / `python -m radixserve.launch_server`: parse flags and serve.
    Returns the exit code (0 after a clean SIGINT/SIGTERM shutdown)."""
    parser = argparse.ArgumentParser(prog="radixserve serve", description="radixserve HTTP server")
    ServerArgs.add_cli_args(parser)
    return serve(ServerArgs.from_cli_args(parser.parse_args(argv)))


def serve(server_args: ServerArgs) -> int:
    """Serve until stopped; the exit code (0 after a clean SIGINT/SIGTERM shutdown)."""
    try:
        launch_server(server_args)
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    except ValueError as exc:  # flags that cannot run together, found by resolve()
        logging.getLogger(__name__).error("%s", exc)
        return 2
    return 0


def launch_server(server_args: ServerArgs,
                  scheduler_factory: SchedulerFactory | None = None) -> None:
    """Serve until SIGINT/SIGTERM; raises SystemExit(1) if a child dies or start-up fails.
    A node other than node 0 (--node-rank > 0) serves no HTTP: it runs its ranks until rank 0
    stops them."""
    server_args.resolve()
    configure_logging(server_args.log_level, "server")
    bound_matmul_caches(server_args)  # before any child is spawned: they inherit it
    if server_args.node_rank > 0:
        _serve_headless_node(server_args)
        return
    # fail fast, before any process loads anything: the port must be free (it stays bound, and
    # uvicorn serves on this socket) and the model path must resolve, both before any child
    # starts; the config and the split are checked while the children import their modules
    listen_socket = _bind_listen_socket(server_args)
    try:
        _resolve_or_exit(server_args)
        port_args = PortArgs.create(server_args.dp_size)
        group = ProcessGroup(server_args, port_args, scheduler_factory)
    except BaseException:
        listen_socket.close()
        raise
    group.spawn()
    try:
        source = _check_model(server_args)
    except BaseException:
        group.shutdown()
        listen_socket.close()
        raise
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _raise_shutdown)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
    state = ServerState()
    try:
        group.release()
        yield_to_compute(server_args, "HTTP")  # after the children started (cpu_priority.py)
        logger.info("loading the model in the scheduler process (pid %s)",
                    group.pid_of("scheduler"))
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load") as pool:
            tokenizer = pool.submit(load_tokenizer, server_args)  # overlaps the model load
            model_info = group.wait_ready()  # a child's failure is reported first
            _serve(server_args, port_args, group, model_info, tokenizer.result(), state,
                   listen_socket, source.generation_defaults, source.served_model_name)
    except ChildFailedError as exc:
        state.exit_code = 1
        logger.error("%s", exc)
    except ShutdownRequested as exc:
        logger.info("shutting down (%s)", exc)
    finally:
        group.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if state.exit_code:
        raise SystemExit(state.exit_code)


def _serve_headless_node(server_args: ServerArgs) -> None:
    """Node n > 0: the model checks node 0 makes first (one error line and exit code 1, not a
    traceback from each rank), then this node's ranks until rank 0 stops them."""
    _resolve_or_exit(server_args)
    _check_model(server_args)
    code = run_headless_node(server_args)
    if code:
        raise SystemExit(code)


def _bind_listen_socket(server_args: ServerArgs) -> socket.socket:
    """The HTTP socket, bound; one error line and exit code 1 when the port is taken."""
    family = socket.AF_INET6 if ":" in server_args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((server_args.host, server_args.port))
    except OSError as exc:
        sock.close()
        logger.error("cannot listen on %s:%d: %s (another server there? pick --port)",
                     server_args.host, server_args.port, exc.strerror or exc)
        raise SystemExit(1) from None
    return sock


@contextlib.contextmanager
def _model_errors_exit() -> Iterator[None]:
    """A model that cannot be served: one error line and exit code 1, no traceback."""
    try:
        yield
    except (OSError, ValueError) as exc:
        logger.error("cannot serve the model: %s", exc)
        raise SystemExit(1) from None


def _resolve_or_exit(server_args: ServerArgs) -> None:
    """--model-path names a local model, the bundled one or a hub repo (fetched into the hub
    cache if needed). Imports neither transformers' config classes nor the model code, so a
    wrong path fails before any child starts."""
    from radixserve.loader.model_resolution import resolve_model_path
    with _model_errors_exit():
        resolve_model_path(server_args.model_path)


def _check_model(server_args: ServerArgs) -> Any:
    """The model's config loads, names an architecture we have, a quantisation we read, and
    the tensor-parallel split is possible; its weight files are there (the index's shards):
    what would otherwise fail in the children, after they start. Returns its ModelSource."""
    from radixserve.executor.embedding import configure_for_embedding
    from radixserve.executor.model_runner import check_tensor_parallel
    from radixserve.layers.quantization.fp8 import fp8_config
    from radixserve.layers.quantization.int4 import int4_config
    from radixserve.loader import load_model_source
    from radixserve.loader.model_resolution import no_tokenizer_files
    from radixserve.models.registry import model_class
    with _model_errors_exit():
        source = load_model_source(server_args.model_path, server_args.load_format,
                                   server_args.model_overrides())
        model_class(source.model_config)
        configure_for_embedding(source.model_config, server_args.is_embedding)
        fp8_config(source.hf_config.get("quantization_config"), server_args.quantization)
        int4_config(source.hf_config.get("quantization_config"), server_args.quantization,
                    dummy=source.weights is None)
        check_tensor_parallel(source.model_config, server_args.tp_size)
        source.model_config.resolve_context_length(server_args.context_length)
        if not server_args.skip_tokenizer_init and not server_args.tokenizer_path and \
                source.tokenizer_source is None:
            raise no_tokenizer_files(source.model_path)
    return source


def _serve(server_args: ServerArgs, port_args: PortArgs, group: ProcessGroup,
           model_info: dict[str, Any], tokenizer: Any, state: ServerState,
           listen_socket: socket.socket | None = None,
           generation_defaults: dict[str, Any] | None = None,
           model_name: str = DEFAULT_MODEL_NAME) -> None:
    name = served_model_name(server_args, model_name)
    state.model_name = name
    tm = TokenizerManager(port_args, tokenizer, model_info, ServerMetrics(name),
                          log_requests=server_args.log_requests,
                          router=DataParallelRouter(server_args.dp_size,
                                                    server_args.load_balance_method),
                          generation_defaults=generation_defaults,
                          image_options=ImageOptions.of(server_args))
    aliases = accepted_model_names(server_args, model_name)

    def server_info() -> dict[str, Any]:
        follower_pids = group.follower_pids_per_replica()
        args = {k: v for k, v in dataclasses.asdict(server_args).items() if k != "api_key"}
        return {"server_args": args, "served_model_name": name, "model_info": model_info,
                "scheduler_pid": group.pid_of("scheduler"),
                "scheduler_pids": group.pids_of_schedulers(),
                "detokenizer_pid": group.pid_of("detokenizer"),
                "tp_follower_pids": [pid for pids in follower_pids for pid in pids],
                "tp_follower_pids_per_replica": follower_pids,
                "ready": state.ready}

    app = build_app(tm, server_args.api_key, name, aliases, server_info, lambda: state.ready,
                    server_args.max_request_bytes, server_args.tool_call_parser,
                    server_args.incremental_streaming_output, server_args.reasoning_parser,
                    server_args.exclude_tools_when_tool_choice_none, server_args.is_embedding)
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                            log_level=server_args.log_level, timeout_keep_alive=5,
                            timeout_graceful_shutdown=5, access_log=server_args.log_requests)
    state.tm = tm
    state.server = GracefulServer(config, tm, server_args.shutdown_timeout)
    group.start_watchdog(state.fail)
    threading.Thread(target=_warm_up, args=(server_args, state, tokenizer is None), daemon=True,
                     name="warm-up").start()
    state.server.run(sockets=[listen_socket] if listen_socket is not None else None)


def _warm_up(server_args: ServerArgs, state: ServerState, ids_only: bool) -> None:
    server = state.server
    assert server is not None
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    host = "127.0.0.1" if server_args.host in ("0.0.0.0", "") else server_args.host
    host = "[::1]" if host == "::" else host
    payload: dict[str, Any] = {"sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    if ids_only:
        payload["input_ids"] = [10, 11, 12, 13]
    else:
        payload["text"] = "The capital city of France is"
    route = "/generate"
    if server_args.is_embedding:  # it generates nothing: a prompt's pass, through /encode
        route = "/encode"
        del payload["sampling_params"]
    request = urllib.request.Request(
        f"http://{host}:{server_args.port}{route}", data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", WARM_UP_HEADER: "1",
                 **({"Authorization": f"Bearer {server_args.api_key}"}
                    if server_args.api_key else {})})
    try:
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=WARMUP_TIMEOUT_S) as response:
            body = json.loads(response.read())
        logger.info("warm-up request passed in %.2f s: %r", time.perf_counter() - started,
                    body.get("text", body.get("output_ids")))
    except Exception as exc:  # noqa: BLE001 - any failure here means the server is broken
        state.fail(f"the warm-up request failed: {exc!r}")
        return
    state.ready = True
    logger.info("radixserve is ready on http://%s:%s (model %s)", host, server_args.port,
                state.model_name)
