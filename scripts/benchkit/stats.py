"""Percentiles of measured latencies, as the benchmarks report them."""

from __future__ import annotations

import numpy as np


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile of `values`; None when a phase measured nothing."""
    return float(np.percentile(values, q)) if values else None


def pcts(values) -> dict[str, float]:
    """p50, p90, p99 and the mean, rounded to 0.01."""
    x = np.asarray(values, dtype=float)
    return {f"p{q}": round(float(np.percentile(x, q)), 2) for q in (50, 90, 99)} | {
        "mean": round(float(x.mean()), 2)
    }
