"""Percentiles of measured latencies and the server's TTFT phases, as benchmarks report them."""

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


# The server's `timings` phases on the way to the first token, in the order a request meets them.
TTFT_PHASES = (
    "handover admit body parse media plan route encode_hop_in pixels_fetch encode_queue "
    "encode_compute transfer prefill_call prefill_hop_in prefill_queue item_wait prefill_compute "
    "prefill_publish prefill_hop_out first_token"
).split()


def tail_phases(ttfts_ms: list[float], timings: list[dict], share: float = 0.1) -> dict[str, float]:
    """Medians of each TTFT phase over the slowest `share` of the requests (by client TTFT):
    where a tail request's time went. Phases the server did not report count as 0."""
    ranked = sorted(zip(ttfts_ms, timings), key=lambda pair: pair[0])
    slowest = [t or {} for _, t in ranked[-max(1, int(len(ranked) * share)) :]]
    med = lambda key: round(float(np.median([t.get(key, 0.0) for t in slowest])), 2)  # noqa: E731
    return {"server_ttft_ms": med("ttft_ms")} | {f"{p}_ms": med(f"{p}_ms") for p in TTFT_PHASES}
