"""Prometheus metrics of the serving path, on a registry of their own (GET /metrics).

Names and labels follow vLLM's (`vllm:time_to_first_token_seconds{model_name=...}` is
`epd:time_to_first_token_seconds{model_name=...}` here), so a vLLM dashboard works after
replacing the prefix; epd's own series (router estimate, per-stage latency, encoder batch,
retries) sit beside them. Every series carries `model_name`. The full list is in the
README ("Metrics"); docs/grafana/epd.json is a dashboard over them.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cluster.worker_metrics import WorkerStats, WorkerStatsCollector

PREFIX = "epd:"
# vLLM's request-latency buckets; the top ones are cut at the request timeout, which is added.
_LATENCY_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
STEP_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def latency_buckets_s(timeout_s: float) -> tuple[float, ...]:
    """Latency buckets that end at the request timeout, so no finished request is only in +Inf."""
    return tuple(b for b in _LATENCY_BUCKETS_S if b < timeout_s) + (float(timeout_s),)


class _Bound:
    """A metric family with `model_name` bound, so call sites pass only their own labels."""

    def __init__(self, family, model_name: str):
        self.family, self.model_name = family, model_name
        self._plain = family.labels(model_name) if len(family._labelnames) == 1 else None

    def labels(self, *values: str):
        return self.family.labels(self.model_name, *values)

    def __getattr__(self, name: str):  # inc / observe / set on a family with no labels of its own
        return getattr(self._plain, name)


class Metrics:
    def __init__(self, model_name: str = "", request_timeout_s: float = 120.0) -> None:
        self.registry = CollectorRegistry()
        self.worker_registry = CollectorRegistry()  # per-worker series: not merged over replicas
        self.model_name = model_name
        latency = latency_buckets_s(request_timeout_s)
        # vLLM's names
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.", latency)
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Time between two output chunks of a request.",
            STEP_BUCKETS_S,
        )
        self.tpot = self._histogram(
            "request_time_per_output_token_seconds",
            "A request's mean time per output token after the first.",
            STEP_BUCKETS_S,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to last token.", latency
        )
        self.queue_time = self._histogram(
            "request_queue_time_seconds",
            "Time a request waited in a prefill worker's queue.",
            latency,
        )
        self.prefill_time = self._histogram(
            "request_prefill_time_seconds", "Time a request's prefill ran.", latency
        )
        self.decode_time = self._histogram(
            "request_decode_time_seconds", "First token to last token.", latency
        )
        self.request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens prefilled.")
        self.completion_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.success = self._counter(
            "request_success", "Finished requests by finish reason.", "finished_reason"
        )
        self.running = self._gauge(
            "num_requests_running", "Requests past their first token, still generating."
        )
        self.waiting = self._gauge(
            "num_requests_waiting", "Admitted requests waiting for their first token."
        )
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.mm_cache_queries = self._counter(
            "mm_cache_queries", "Media items looked up in the encoder cache."
        )
        self.mm_cache_hits = self._counter(
            "mm_cache_hits", "Media items found in the encoder cache."
        )
        # epd's own
        self.requests = self._counter(
            "requests",
            "Requests by outcome: ok, an HTTP status, or aborted by the client.",
            "status",
        )
        self.estimated_ttft = self._histogram(
            "estimated_ttft_seconds",
            "The router's TTFT estimate for the workers it chose.",
            latency,
        )
        self.ttft_estimate_error = self._histogram(
            "ttft_estimate_abs_error_seconds", "|measured - estimated| TTFT.", latency
        )
        self.stage = self._histogram(
            "stage_latency_seconds", "Latency of one pipeline stage.", latency, "stage"
        )
        self.encoder_batch = self._histogram(
            "encoder_batch_size", "Items per encoder forward pass.", (1, 2, 4, 8, 16, 32, 64)
        )
        self.queue_depth = self._gauge("queue_depth", "Outstanding jobs per worker kind.", "kind")
        self.media_bytes_in_flight = self._gauge(
            "media_bytes_in_flight",
            "Decoded media the ingress holds or is decoding, in bytes "
            "(limits.max_decoded_media_mb).",
        )
        self.retries = self._counter(
            "retries",
            "Requests resumed on other workers after a worker failed, by the failed kind.",
            "kind",
        )
        self.route_syncs = self._counter(
            "route_syncs",
            "Large requests routed on the other ingress replicas' bookings as of now "
            "(router.sync_above_ms), by outcome: shared, or unanswered (the last share served).",
            "outcome",
        )

    def _histogram(self, name: str, doc: str, buckets, *labels: str) -> _Bound:
        return _Bound(
            Histogram(
                PREFIX + name, doc, ["model_name", *labels], buckets=buckets, registry=self.registry
            ),
            self.model_name,
        )

    def _counter(self, name: str, doc: str, *labels: str) -> _Bound:
        return _Bound(
            Counter(PREFIX + name, doc, ["model_name", *labels], registry=self.registry),
            self.model_name,
        )

    def _gauge(self, name: str, doc: str, *labels: str) -> _Bound:
        return _Bound(
            Gauge(PREFIX + name, doc, ["model_name", *labels], registry=self.registry),
            self.model_name,
        )

    def track_load(self, waiting: Callable[[], float], running: Callable[[], float]) -> None:
        """Read the admission counts at scrape time rather than mirroring every change."""
        self.waiting.set_function(waiting)
        self.running.set_function(running)

    def track_media(self, in_flight: Callable[[], float]) -> None:
        """Read the in-flight media budget's use at scrape time."""
        self.media_bytes_in_flight.set_function(in_flight)

    def track_workers(self, latest: Callable[[], WorkerStats]) -> None:
        """Series from the workers' own stats (encoder cache states, decode KV in use), read
        from the supervisor's latest poll at scrape time. They sit in a registry of their own:
        every replica sees the same workers, so the replicas' merge (which sums) must not
        take them; the replica that answers a scrape adds them once (`worker_exposition`)."""
        self.worker_registry.register(WorkerStatsCollector(PREFIX, self.model_name, latest))

    def worker_exposition(self) -> bytes:
        return generate_latest(self.worker_registry)

    def record_encoder_lookup(self, hit: bool) -> None:
        self.mm_cache_queries.inc()
        if hit:
            self.mm_cache_hits.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
