"""Prometheus metrics of the serving path, on a registry of their own (GET /metrics)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("epd_requests", "Chat requests by outcome.", ["status"], registry=r)
        self.ttft = Histogram("epd_ttft_seconds", "Time to first token.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.estimated_ttft = Histogram(
            "epd_estimated_ttft_seconds", "The router's TTFT estimate for the pair it chose.", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.ttft_estimate_error = Histogram(
            "epd_ttft_estimate_abs_error_seconds", "|measured - estimated| TTFT.", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.tpot = Histogram("epd_tpot_seconds", "Time per output token after the first.", buckets=STEP_BUCKETS_S, registry=r)
        self.e2e = Histogram("epd_e2e_latency_seconds", "Request latency, arrival to last token.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.stage = Histogram(
            "epd_stage_latency_seconds", "Latency of one pipeline stage.", ["stage"], buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.encoder_batch = Histogram(
            "epd_encoder_batch_size", "Items per encoder forward pass.", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.encoder_cache = Counter("epd_encoder_cache", "Encoder cache lookups by result.", ["result"], registry=r)
        self.prefix_cache_tokens = Counter("epd_prefix_cache_tokens", "Prompt tokens whose KV came from a prefill worker's "
                                           "prefix cache (hit) or was computed (miss).", ["result"], registry=r)
        self.queue_depth = Gauge("epd_queue_depth", "Outstanding jobs per worker kind.", ["kind"], registry=r)
        self.retries = Counter("epd_retries", "Requests resumed on other workers after a worker failed, by the failed kind.",
                               ["kind"], registry=r)
        self.prompt_tokens = Counter("epd_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.completion_tokens = Counter("epd_completion_tokens", "Tokens generated.", registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
