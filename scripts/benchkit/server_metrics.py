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


def pauses_for_short(root: str) -> dict[str, float]:
    """Per worker kind, the long forwards that paused for a short prompt elsewhere on the
    node (actors/engine/node_priority.py) and their ms, summed over the kind's workers."""
    body = httpx.get(f"{root}/health", params={"verbose": 1}, timeout=30).json()
    out: dict[str, float] = {}
    for kind, workers in (body.get("workers") or {}).items():
        stats = [w for w in workers if isinstance(w, dict)]
        out[f"{kind}_pauses"] = sum(w.get("pauses_for_short", 0) for w in stats)
        out[f"{kind}_paused_ms"] = round(sum(w.get("paused_for_short_ms", 0.0) for w in stats))
    return out
