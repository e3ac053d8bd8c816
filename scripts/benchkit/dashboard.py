"""The Grafana dashboard over epd's /metrics (Prometheus data source chosen at import):
its panels and the JSON that scripts/grafana_dashboard.py writes to docs/grafana/epd.json."""

from __future__ import annotations

import json

SEL = '{model_name="$model_name"}'


def _q(metric: str, quantile: float, by: str = "le") -> str:
    rate = f"rate({metric}_bucket{SEL}[$__rate_interval])"
    return f"histogram_quantile({quantile}, sum by({by}) ({rate}))"


def _rate(metric: str, by: str = "") -> str:
    grouping = f" by({by})" if by else ""
    return f"sum{grouping} (rate({metric}{SEL}[$__rate_interval]))"


def _ratio(hits: str, queries: str) -> str:
    return f"{_rate(hits)} / {_rate(queries)}"


# (title, unit, [(legend, PromQL)])
PANELS = [
    (
        "Time to first token",
        "s",
        [
            ("p50", _q("epd:time_to_first_token_seconds", 0.5)),
            ("p99", _q("epd:time_to_first_token_seconds", 0.99)),
        ],
    ),
    (
        "Estimated vs measured TTFT (p50)",
        "s",
        [
            ("measured", _q("epd:time_to_first_token_seconds", 0.5)),
            ("router estimate", _q("epd:estimated_ttft_seconds", 0.5)),
            ("|error| p90", _q("epd:ttft_estimate_abs_error_seconds", 0.9)),
        ],
    ),
    (
        "Inter-token latency",
        "s",
        [
            ("p50", _q("epd:inter_token_latency_seconds", 0.5)),
            ("p99", _q("epd:inter_token_latency_seconds", 0.99)),
        ],
    ),
    (
        "End-to-end latency",
        "s",
        [
            ("p50", _q("epd:e2e_request_latency_seconds", 0.5)),
            ("p99", _q("epd:e2e_request_latency_seconds", 0.99)),
        ],
    ),
    ("Requests by outcome", "reqps", [("{{status}}", _rate("epd:requests_total", "status"))]),
    (
        "Finished by reason",
        "reqps",
        [("{{finished_reason}}", _rate("epd:request_success_total", "finished_reason"))],
    ),
    (
        "Running / waiting",
        "short",
        [
            ("running", f"sum(epd:num_requests_running{SEL})"),
            ("waiting", f"sum(epd:num_requests_waiting{SEL})"),
        ],
    ),
    (
        "Tokens per second",
        "short",
        [
            ("prompt", _rate("epd:prompt_tokens_total")),
            ("generation", _rate("epd:generation_tokens_total")),
        ],
    ),
    (
        "Prefix cache hit rate",
        "percentunit",
        [("tokens", _ratio("epd:prefix_cache_hits_total", "epd:prefix_cache_queries_total"))],
    ),
    (
        "Encoder cache hit rate",
        "percentunit",
        [("items", _ratio("epd:mm_cache_hits_total", "epd:mm_cache_queries_total"))],
    ),
    ("Stage latency p99", "s", [("{{stage}}", _q("epd:stage_latency_seconds", 0.99, "le, stage"))]),
    (
        "Queue and prefill time p90",
        "s",
        [
            ("queue", _q("epd:request_queue_time_seconds", 0.9)),
            ("prefill", _q("epd:request_prefill_time_seconds", 0.9)),
            ("decode", _q("epd:request_decode_time_seconds", 0.9)),
        ],
    ),
    (
        "Encoder batch size (mean)",
        "short",
        [
            (
                "items",
                f"{_rate('epd:encoder_batch_size_sum')} / {_rate('epd:encoder_batch_size_count')}",
            )
        ],
    ),
    (
        "Outstanding jobs per worker kind",
        "short",
        [("{{kind}}", f"sum by(kind) (epd:queue_depth{SEL})")],
    ),
    ("Retries after a worker failed", "reqps", [("{{kind}}", _rate("epd:retries_total", "kind"))]),
    (
        "Large requests routed on fresh shares (several replicas)",
        "reqps",
        [("{{outcome}}", _rate("epd:route_syncs_total", "outcome"))],
    ),
    # Worker series: every replica exposes the same polled values, hence max over replicas first.
    (
        "Encoder cache bytes by state",
        "bytes",
        [("{{state}}", f"sum by(state) (max by(state, encoder) (epd:encoder_cache_bytes{SEL}))")],
    ),
    (
        "Encoder cache evictions",
        "ops",
        [
            (
                "evictions",
                "sum (max by(encoder) "
                f"(rate(epd:encoder_cache_evictions_total{SEL}[$__rate_interval])))",
            )
        ],
    ),
    (
        "Decode KV budget reserved",
        "percentunit",
        [("decode {{decode}}", f"max by(decode) (epd:kv_cache_usage_perc{SEL})")],
    ),
]


def _panel(index: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def dashboard() -> dict:
    variables = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
        {
            "name": "model_name",
            "type": "query",
            "label": "Model",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": "label_values(epd:requests_total, model_name)",
            "refresh": 2,
        },
    ]
    return {
        "title": "epd: disaggregated E/P/D serving",
        "uid": "epd-serving",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "tags": ["epd", "llm"],
        "templating": {"list": variables},
        "panels": [_panel(i, *p) for i, p in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"
