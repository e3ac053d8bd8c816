"""The metric names a dashboard relies on, and the Grafana dashboard over them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchkit import dashboard
from cluster.metrics import Metrics, latency_buckets_s

ROOT = Path(__file__).resolve().parents[2]

_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}


def exported_series() -> set[str]:
    """Every sample name /metrics can carry, from the registry the ingress serves."""
    from actors.engine.encoder_cache import EncoderCache

    metrics = Metrics("m", 120)
    encoder = EncoderCache(1).stats().as_flat_dict()
    metrics.track_workers(
        lambda: {"encoder": [encoder], "decode": [{"kv_reserved_bytes": 0, "kv_budget_bytes": 1}]}
    )
    families = [*metrics.registry.collect(), *metrics.worker_registry.collect()]
    return {f.name + s for f in families for s in _SUFFIXES[f.type]}


def test_every_dashboard_query_names_an_exported_metric():
    board = json.loads((ROOT / "docs" / "grafana" / "epd.json").read_text())
    exported = exported_series()
    queries = [t["expr"] for p in board["panels"] for t in p["targets"]]
    named = {m for q in queries for m in re.findall(r"epd:[a-z0-9_:]+", q)}
    assert len(board["panels"]) >= 10 and named
    assert named <= exported, named - exported
    assert {
        "epd:time_to_first_token_seconds_bucket",
        "epd:num_requests_running",
        "epd:prefix_cache_hits_total",
    } <= named


def test_dashboard_file_is_current():
    assert (ROOT / "docs" / "grafana" / "epd.json").read_text() == dashboard.render()


def test_vllm_names_and_model_label_in_the_exposition():
    metrics = Metrics("tiny", 30)
    metrics.ttft.observe(0.2)
    metrics.requests.labels("ok").inc()
    metrics.stage.labels("prefill").observe(0.01)
    metrics.track_load(lambda: 3, lambda: 4)
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    ttft = families["epd:time_to_first_token_seconds"]
    assert all(s.labels["model_name"] == "tiny" for s in ttft.samples)
    tops = [
        float(s.labels["le"])
        for s in ttft.samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    ]
    assert max(tops) == 30.0
    assert families["epd:requests"].samples[0].labels == {"model_name": "tiny", "status": "ok"}
    assert families["epd:num_requests_waiting"].samples[0].value == 3
    assert families["epd:num_requests_running"].samples[0].value == 4


def test_latency_buckets_end_at_the_timeout():
    assert latency_buckets_s(120)[-1] == 120 and all(b < 120 for b in latency_buckets_s(120)[:-1])
    assert latency_buckets_s(0.5) == (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5)


def test_worker_stats_become_encoder_cache_and_kv_series():
    from actors.engine.encoder_cache import EncoderCache

    cache = EncoderCache(capacity_bytes=100)
    assert cache.lookup("a", "r1") is None
    cache.start("a", "r1", pending=None)
    cache.fill("a", "A", 30)
    cache.lookup("a", "r2")
    polled = {
        "encoder": [{"error": "restarting"}, {"pid": 1, **cache.stats().as_flat_dict()}],
        "decode": [{"kv_reserved_bytes": 50, "kv_budget_bytes": 200}],
    }
    metrics = Metrics("tiny", 30)
    metrics.track_workers(lambda: polled)
    assert b"encoder_cache" not in metrics.exposition(), (
        "worker series must stay out of what replicas merge (and sum)"
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(metrics.worker_exposition().decode())
        for s in f.samples
    }
    on_encoder_1 = (("encoder", "1"), ("model_name", "tiny"))
    assert samples[("epd:encoder_cache_entries", (*on_encoder_1, ("state", "referenced")))] == 1
    assert samples[("epd:encoder_cache_bytes", (*on_encoder_1, ("state", "referenced")))] == 30
    assert samples[("epd:encoder_cache_entries", (*on_encoder_1, ("state", "cached")))] == 0
    assert samples[("epd:encoder_cache_hits_total", on_encoder_1)] == 1
    assert samples[("epd:encoder_cache_misses_total", on_encoder_1)] == 1
    assert samples[("epd:encoder_cache_evictions_total", on_encoder_1)] == 0
    assert samples[("epd:encoder_cache_capacity_bytes", on_encoder_1)] == 100
    assert not any(("encoder", "0") in labels for _, labels in samples), (
        "a restarting worker has no series"
    )
    assert samples[("epd:kv_cache_usage_perc", (("decode", "0"), ("model_name", "tiny")))] == 0.25
