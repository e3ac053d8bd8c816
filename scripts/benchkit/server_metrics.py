"""A served app's Prometheus /metrics, read between a benchmark's phases."""

from __future__ import annotations

import re

import httpx


def metrics_snapshot(root: str) -> dict[str, float]:
    """Every sample of `root`/metrics by name and labels, the model_name label dropped (one
    model per app)."""
    text = httpx.get(f"{root}/metrics", timeout=30).text
    samples = (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))
    return {re.sub(r'model_name="[^"]*",?', "", k): float(v) for k, v in samples}


def stage_mean_ms(before: dict, after: dict, stage: str) -> float | None:
    """Mean ms of `stage` between two snapshots; None where none ran."""
    key = "epd:stage_latency_seconds_{}" + f'{{{{stage="{stage}"}}}}'
    n = after.get(key.format("count"), 0) - before.get(key.format("count"), 0)
    return (after[key.format("sum")] - before.get(key.format("sum"), 0)) / n * 1e3 if n else None
