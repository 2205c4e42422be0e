"""Online serving benchmark: an asyncio load generator for radixserve or any OpenAI-compatible
server. `python -m radixserve.bench.serving --help` (also `radixserve bench serving`).

One run: build the workload, send one warm-up request, then release requests by Poisson
arrivals at --request-rate (inf: all at once) under an optional --max-concurrency cap, and
report throughput and latency (metrics.py). Each run prints a table and appends one JSON line to
--output-file; --request-rate-range runs several rates, each with its own seed (seed + index) so
no run is served from prompts another run left in the server's prefix cache.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import sys
import time
import urllib.request
from datetime import datetime, timezone
from typing import Any, AsyncIterator

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm

from radixserve.bench.backends import BACKENDS, RequestInput
from radixserve.bench.cli_support import (BenchError, int_at_least, json_object, output_file,
                                          request_rate, request_rates, run_command)
from radixserve.bench.datasets import (SampleRequest, TokenSampler, Tokenizer, add_dataset_args,
                                       attach_prompt_text, build_dataset, check_not_empty,
                                       load_tokenizer)
from radixserve.bench.metrics import RequestOutput, compute_metrics, format_report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="radixserve")
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="model name for OpenAI APIs (default: the "
                   "first of /v1/models); for radixserve, which tokenizer to load")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder, .gguf file, model name "
                   "or HF id (ShareGPT lengths, chat prompts, random ids without special "
                   "tokens); radixserve backend default: the server's bundled model's")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--lora-name", nargs="+", default=None,
                   help="LoRA adapters the requests name, in turn (radixserve: lora_path; "
                        "OpenAI backends: the model field), as SGLang's bench_serving")
    add_dataset_args(p)
    p.add_argument("--request-rate", type=request_rate, default=float("inf"),
                   help="requests/s, Poisson arrivals; inf sends all at once")
    p.add_argument("--request-rate-range", type=request_rates, default=None,
                   help='comma-separated rates to sweep, e.g. "1,2,4,inf"')
    p.add_argument("--max-concurrency", type=int_at_least(1), default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-warmup", action="store_true")
    p.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache before each run (radixserve, SGLang)")
    p.add_argument("--extra-request-body", type=json_object, default=None,
                   help="JSON object merged into every body (nested objects key by key)")
    p.add_argument("--output-file", type=output_file, default=None,
                   help="append one JSON line per run")
    p.add_argument("--output-details", action="store_true",
                   help="also store per-request lengths and latencies in the JSON line")
    p.add_argument("--label", default=None, help="name of this series in plots")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def parse_rates(args: argparse.Namespace) -> list[float]:
    return args.request_rate_range or [args.request_rate]


def build_requests(args: argparse.Namespace, tokenizer: Tokenizer | None, seed: int,
                   vocab_size: int | None = None) -> list[SampleRequest]:
    requests = build_dataset(args, tokenizer, seed, vocab_size)
    if args.backend == "openai-chat":
        if tokenizer is None and any(r.prompt_text is None for r in requests):
            raise BenchError("openai-chat sends text: pass --tokenizer to decode token ids")
        if tokenizer is not None:
            attach_prompt_text(requests, tokenizer)
    return requests


async def poisson_arrivals(requests: list[SampleRequest], rate: float,
                           rng: np.random.Generator) -> AsyncIterator[SampleRequest]:
    """Yield requests with exponential gaps of mean 1/rate (no gaps when rate is inf)."""
    for i, req in enumerate(requests):
        yield req
        if math.isinf(rate) or i == len(requests) - 1:
            continue
        await asyncio.sleep(rng.exponential(1.0 / rate))


class Client:
    """Turns SampleRequests into RequestInputs for the chosen backend and sends them."""

    def __init__(self, args: argparse.Namespace, base_url: str, model: str | None) -> None:
        path, self.send = BACKENDS[args.backend]
        self.api_url = base_url + path
        self.model = model
        self.stream = not args.disable_stream
        self.extra_body = args.extra_request_body or {}
        # --lora-name: each request names the next adapter in turn (the warm-up none)
        self.lora_names = itertools.cycle(args.lora_name) if args.lora_name else None

    def make_input(self, req: SampleRequest, warm_up: bool = False) -> RequestInput:
        lora = None if warm_up or self.lora_names is None else next(self.lora_names)
        return RequestInput(api_url=self.api_url, prompt_len=req.prompt_len,
                            output_len=req.output_len, prompt_ids=req.prompt_ids,
                            prompt_text=req.prompt_text, model=self.model, stream=self.stream,
                            extra_body=self.extra_body,  # (--api-key: the session's header)
                            lora_name=lora)


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    """--api-key as a header, for every request to the server (generation or not)."""
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def fetch_model_name(session: aiohttp.ClientSession, base_url: str) -> str | None:
    try:
        async with session.get(base_url + "/v1/models") as response:
            data = await response.json()
        return data["data"][0]["id"]
    except Exception:
        return None


async def fetch_server_cache_hit_rate(session: aiohttp.ClientSession,
                                      base_url: str) -> float | None:
    """The first Prometheus sample whose metric name mentions cache_hit_rate, if any."""
    try:
        async with session.get(base_url + "/metrics") as response:
            if response.status != 200:
                return None
            text = await response.text()
    except Exception:
        return None
    for line in text.splitlines():
        if line.startswith("#") or "cache_hit_rate" not in line.split(" ")[0]:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
        return value if math.isfinite(value) else None
    return None


WARMUP_MARKER = "[warm-up]"


def make_warmup(requests: list[SampleRequest], tokenizer: Tokenizer | None, seed: int,
                vocab_size: int | None = None) -> SampleRequest:
    """A prompt about as long as the first one that starts as none of them does, so the warm-up
    caches nothing a request can use: fresh random ids, or the first prompt's words reversed."""
    first = requests[0]
    warm = SampleRequest(prompt_len=first.prompt_len, output_len=min(first.output_len, 16))
    if first.prompt_ids is not None:
        sampler = TokenSampler(tokenizer, vocab_size)
        warm.prompt_ids = sampler.sample(np.random.default_rng(seed + 7919), first.prompt_len)
    if first.prompt_text is None:
        return warm
    if warm.prompt_ids is not None and tokenizer is not None:
        warm.prompt_text = tokenizer.decode(warm.prompt_ids, skip_special_tokens=True)
    else:
        warm.prompt_text = unrelated_text(first.prompt_text, requests)
    return warm


def unrelated_text(text: str, requests: list[SampleRequest]) -> str:
    """`text`'s words in reverse order, led by WARMUP_MARKER where they would still begin with
    the first word of a prompt of `requests` (a one-word or palindromic text, say)."""
    words = text.split()[::-1]
    first_words = {r.prompt_text.split()[0] for r in requests
                   if r.prompt_text and r.prompt_text.split()}
    if not words or words[0] in first_words:
        words.insert(0, WARMUP_MARKER)
    return " ".join(words)


def base_url_of(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def fetch_vocab_size(base_url: str, headers: dict[str, str]) -> int | None:
    """The served model's vocabulary size from radixserve's (and SGLang's) /get_model_info."""
    request = urllib.request.Request(base_url + "/get_model_info", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            value = json.loads(response.read()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


async def flush_cache(session: aiohttp.ClientSession, base_url: str) -> None:
    try:
        async with session.post(base_url + "/flush_cache") as response:
            if response.status != 200:
                print(f"warning: /flush_cache answered HTTP {response.status}")
    except aiohttp.ClientError as exc:
        raise BenchError(f"--flush-cache: no answer from {base_url}/flush_cache ({exc})")


async def run_benchmark(args: argparse.Namespace, requests: list[SampleRequest], rate: float,
                        seed: int, warmup: SampleRequest | None = None) -> dict[str, Any]:
    """One run at one request rate; returns the JSON record (also printed as a table)."""
    base_url = base_url_of(args)
    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, read_bufsize=1 << 20,
                                     headers=auth_headers(args)) as session:
        model = args.model
        if args.backend != "radixserve" and model is None:
            model = await fetch_model_name(session, base_url)
        client = Client(args, base_url, model)
        if args.flush_cache:
            await flush_cache(session, base_url)
        if warmup is not None:
            warm = await client.send(session, client.make_input(warmup, warm_up=True))
            if not warm.success:
                raise BenchError(f"warm-up request failed: {warm.error}")

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        pbar = tqdm(total=len(requests), disable=args.disable_tqdm)

        async def send_one(req: SampleRequest) -> RequestOutput:
            if semaphore is None:
                out = await client.send(session, client.make_input(req))
            else:
                async with semaphore:
                    out = await client.send(session, client.make_input(req))
            pbar.update(1)
            return out

        start = time.perf_counter()
        tasks = [asyncio.create_task(send_one(req))
                 async for req in poisson_arrivals(requests, rate, np.random.default_rng(seed))]
        outputs: list[RequestOutput] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        pbar.close()
        server_hit_rate = await fetch_server_cache_hit_rate(session, base_url)

    metrics = compute_metrics(outputs, duration)
    record: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "label": args.label or f"{args.backend}@{base_url}",
        "backend": args.backend, "base_url": base_url, "model": model,
        "lora_names": args.lora_name, "dataset_name": args.dataset_name, "num_prompts": len(requests),
        "request_rate": None if math.isinf(rate) else rate,
        "max_concurrency": args.max_concurrency, "seed": seed,
        "stream": not args.disable_stream, "server_cache_hit_rate": server_hit_rate,
    }
    record.update(metrics.to_flat_dict())
    if args.output_details:
        record["details"] = {"prompt_lens": [o.prompt_len for o in outputs],
                             "output_lens": [o.output_len for o in outputs],
                             "ttfts": [o.ttft for o in outputs],
                             "latencies": [o.latency for o in outputs],
                             "errors": [o.error for o in outputs]}
    header = {"Backend": args.backend, "Dataset": args.dataset_name,
              "Request rate (req/s)": "inf" if math.isinf(rate) else rate,
              "Max concurrency": args.max_concurrency or "none",
              "Server cache hit rate": server_hit_rate}
    print(format_report("Serving Benchmark Result", header, metrics))
    if metrics.failed and metrics.completed:
        print(f"warning: {metrics.failed} of {len(outputs)} requests failed")
    if metrics.output_len_mismatches:
        print(f"warning: {metrics.output_len_mismatches} requests returned a different number of "
              "tokens than asked for (does the server honour ignore_eos?)")
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return record


def resolve_tokenizer(args: argparse.Namespace) -> Tokenizer | None:
    """--tokenizer if given; for our own server, the bundled model's tokenizer; else none
    (random datasets then draw ids from a range every common vocabulary holds)."""
    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if args.backend == "radixserve":
        return load_tokenizer(None, args.model)
    return None


def check_some_succeeded(record: dict[str, Any]) -> None:
    """A run in which every request failed measured nothing: an error, not a result."""
    if record["completed"] == 0:
        first_error = record["errors"][0] if record["errors"] else "none reported"
        raise BenchError(f"all {record['failed']} requests failed (first error: "
                         f"{first_error[:200]})")


def run_rates(args: argparse.Namespace) -> int:
    tokenizer = resolve_tokenizer(args)
    # random ids must fit the served model's vocabulary (a small one, with dummy weights)
    vocab_size = fetch_vocab_size(base_url_of(args), auth_headers(args)) \
        if args.backend == "radixserve" else None
    for index, rate in enumerate(parse_rates(args)):
        seed = args.seed + index
        requests = check_not_empty(build_requests(args, tokenizer, seed, vocab_size))
        warmup = None if args.disable_warmup else \
            make_warmup(requests, tokenizer, seed, vocab_size)
        check_some_succeeded(asyncio.run(run_benchmark(args, requests, rate, seed, warmup)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: run_rates(args))


if __name__ == "__main__":
    sys.exit(main())
