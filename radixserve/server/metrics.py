"""Prometheus metrics of the server (GET /metrics), on a private registry.

Request-level figures are observed in the TokenizerManager as outputs arrive; gauges of the
scheduler (running/queued requests, KV pool usage, radix cache hit rate, retractions) are copied
from the states the schedulers send unasked (SchedulerStateUpdate: every 0.5 s of work and on
going idle) and from each /get_server_info answer, so a scrape never waits for a turn.
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from radixserve.core.io_struct import InternalState

PREFIX = "radixserve:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# no `<name>_created` series beside every counter and histogram (a timestamp per label set that
# doubles what a scrape reads and nobody charts; vLLM turns them off too). Process-wide: this
# module lives in the HTTP process, whose only metrics are these.
disable_created_metrics()


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.requests = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                                labels + ["finish_reason"], registry=reg)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed",
                                     labels, registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated",
                                         labels, registry=reg)
        self.cached_tokens = Counter(PREFIX + "cached_prompt_tokens",
                                     "Prompt tokens served from the radix cache", labels,
                                     registry=reg)
        self.lora_requests = Counter(PREFIX + "lora_requests", "Finished requests on each LoRA "
                                     "adapter (--lora-paths)", labels + ["lora_name"],
                                     registry=reg)
        self.lora_generation_tokens = Counter(PREFIX + "lora_generation_tokens",
                                              "Tokens generated on each LoRA adapter",
                                              labels + ["lora_name"], registry=reg)
        self.image_inputs = Counter(PREFIX + "image_inputs", "Images of finished requests",
                                    labels, registry=reg)
        self.image_inputs.labels(model_name)  # the series exists from the start, at 0
        # streamed requests as their tokens arrive; non-streamed ones (whose tokens reach this
        # process at their end) from the scheduler's time of their first token
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between two output tokens (streamed requests)", labels,
                             buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=_LATENCY_BUCKETS, registry=reg)
        self.num_running = Gauge(PREFIX + "num_running_reqs", "Requests in the running batch",
                                 labels, registry=reg)
        self.num_queued = Gauge(PREFIX + "num_queued_reqs", "Requests waiting to be scheduled",
                                labels, registry=reg)
        self.token_usage = Gauge(PREFIX + "token_usage", "Fraction of the KV pool in use",
                                 labels, registry=reg)
        self.cache_hit_rate = Gauge(PREFIX + "cache_hit_rate", "Radix cache hit rate (tokens)",
                                    labels, registry=reg)
        self.spec_accept_length = Gauge(PREFIX + "spec_accept_length",
                                        "Speculative decoding: tokens a request gains per "
                                        "verify step (0 without it)", labels, registry=reg)
        # a counter (as vLLM's num_preemptions), fed with the growth of the schedulers' total
        self.retractions = Counter(PREFIX + "num_retractions",
                                   "Requests retracted to the queue (their KV freed)", labels,
                                   registry=reg)
        self.retractions.labels(model_name)  # the series exists from the start, at 0
        self._retractions_seen = 0
        # every HTTP answer (server/http_metrics.py), by method, route template and status
        self.http_responses = Counter(PREFIX + "http_responses",
                                      "HTTP responses by method, route and status code",
                                      ["method", "route", "status"], registry=reg)
        # the per-token histograms' children, looked up once (labels() costs a lock and a
        # dict lookup, and these are observed for every streamed token)
        self._ttft_child = self.ttft.labels(model_name)
        self._itl_child = self.itl.labels(model_name)

    def observe_tokens(self, now: float, created: float, first_token_time: float | None,
                       last_token_time: float | None, num_new_tokens: int) -> None:
        """Called when `num_new_tokens` > 0 new output tokens of one request arrive."""
        if first_token_time is None:
            self._ttft_child.observe(now - created)
            num_new_tokens -= 1
        if last_token_time is not None and num_new_tokens > 0:
            per_token = (now - last_token_time) / num_new_tokens
            child = self._itl_child
            for _ in range(num_new_tokens):
                child.observe(per_token)

    def observe_first_token(self, latency: float) -> None:
        """A time to first token measured apart from the tokens' arrival (non-streamed
        requests: the scheduler's time of the first sample)."""
        self._ttft_child.observe(latency)

    def observe_finish(self, finish_type: str, prompt_tokens: int, completion_tokens: int,
                       cached_tokens: int, e2e_latency: float,
                       lora_name: str | None = None, num_images: int = 0) -> None:
        name = self.model_name
        if num_images:
            self.image_inputs.labels(name).inc(num_images)
        if lora_name is not None:
            self.lora_requests.labels(name, lora_name).inc()
            self.lora_generation_tokens.labels(name, lora_name).inc(completion_tokens)
        self.requests.labels(name, finish_type).inc()
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(completion_tokens)
        self.cached_tokens.labels(name).inc(cached_tokens)
        self.e2e.labels(name).observe(e2e_latency)

    def update_state(self, state: InternalState) -> None:
        name = self.model_name
        self.num_running.labels(name).set(state.num_running_reqs)
        self.num_queued.labels(name).set(state.num_queued_reqs)
        self.token_usage.labels(name).set(state.token_usage)
        self.cache_hit_rate.labels(name).set(state.cache_hit_rate)
        self.spec_accept_length.labels(name).set(state.spec_accept_length)
        if state.num_retractions > self._retractions_seen:
            self.retractions.labels(name).inc(state.num_retractions - self._retractions_seen)
            self._retractions_seen = state.num_retractions

    def render(self) -> bytes:
        return generate_latest(self.registry)
