"""Summaries and plots of simulation results.

`summarize(result)` -> a JSON-ready dict:

    ttft_ms          p50 / p90 / p99 / mean / max of simulated TTFT (arrival -> first token,
                     i.e. the end of prefill)
    throughput_rps   completed requests / (last completion - first arrival)
    goodput          fraction of requests with TTFT <= slo_ms, and that count per second
    utilisation      encoder / prefill: busy time / (workers x span);
                     decode: occupied batch slots / (workers x max_batch x span)
    estimate_error_ms mean |router estimate - simulated TTFT| (and the signed mean)
    decode_wait_ms   p50 / p90 / p99 / mean / max of the time a request's KV waited for a decode
                     slot (its stream stalls that long after the first token)
    measured         (trace replays with ttft_ms) the trace's own TTFT percentiles and
                     mean |simulated - measured|

`plot_cost_vs_slo` draws `epd plan --plot`: the cheapest shape's cost for each of several SLOs.

Plots use matplotlib with the Agg backend, imported only when a plot is asked for. It comes
with epd's `plot` extra (installed by ./scripts/setup, with or without --serve); without it
a plot fails with PlotUnavailable, naming what to install.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


def _pcts(x: np.ndarray) -> dict[str, float]:
    if len(x) == 0:
        return {f"p{p}": math.nan for p in PERCENTILES} | {"mean": math.nan, "max": math.nan}
    q = np.percentile(x, PERCENTILES)
    out = {f"p{p}": round(float(v), 3) for p, v in zip(PERCENTILES, q)}
    out["mean"] = round(float(x.mean()), 3)
    out["max"] = round(float(x.max()), 3)
    return out


def summarize(result) -> dict:
    """A JSON-ready summary of one `SimResult` (see module doc)."""
    ttft = result.ttft_ms
    n = len(ttft)
    span = max(result.span_s, 1e-12)
    ok = int(np.count_nonzero(ttft <= result.slo_ms))
    err = result.estimate_ms - ttft
    out = {
        "policy": result.policy,
        "cluster": result.cluster,
        "workload": result.workload,
        "requests": n,
        "offered_rps": round(result.offered_rps, 4),
        "load": None if result.load is None else round(result.load, 4),
        "ttft_ms": _pcts(ttft),
        "throughput_rps": round(n / span, 4),
        "goodput": {
            "slo_ms": result.slo_ms,
            "fraction": round(ok / n, 6) if n else math.nan,
            "rps": round(ok / span, 4),
        },
        "utilisation": {k: round(v, 4) for k, v in result.utilisation.items()},
        "estimate_error_ms": {
            "mean_abs": round(float(np.abs(err).mean()), 3) if n else math.nan,
            "mean_signed": round(float(err.mean()), 3) if n else math.nan,
        },
        "encoder_cache_hit_rate": round(result.cache_hits / result.media_items, 4)
        if result.media_items
        else None,
        "sim_seconds": round(result.span_s, 3),
        **(
            {}
            if getattr(result, "decode_wait_ms", None) is None
            else {"decode_wait_ms": _pcts(result.decode_wait_ms)}
        ),
        "wall_seconds": round(result.wall_s, 3),
    }
    m = result.measured_ttft_ms
    if m is not None:
        have = ~np.isnan(m)
        if have.any():
            out["measured"] = {
                "ttft_ms": _pcts(m[have]),
                "mean_abs_sim_error_ms": round(float(np.abs(ttft[have] - m[have]).mean()), 3),
            }
    return out


def format_table(summaries: Sequence[Mapping]) -> str:
    """A plain-text comparison table, one row per summary."""
    head = (
        f"{'policy':<14}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}{'tput/s':>10}"
        f"{'good%':>8}{'|err|':>9}{'util E/P/D':>17}{'wall s':>8}"
    )
    lines = [head, "-" * len(head)]
    for s in summaries:
        t = s["ttft_ms"]
        u = s["utilisation"]
        util = f"{u.get('encoder', 0):.2f}/{u.get('prefill', 0):.2f}/{u.get('decode', 0):.2f}"
        lines.append(
            f"{s['policy']:<14}{t['p50']:>10.1f}{t['p90']:>10.1f}{t['p99']:>10.1f}"
            f"{t['mean']:>10.1f}"
            f"{s['throughput_rps']:>10.2f}{100 * s['goodput']['fraction']:>7.1f}%"
            f"{s['estimate_error_ms']['mean_abs']:>9.1f}{util:>17}{s['wall_seconds']:>8.1f}"
        )
    return "\n".join(lines)


def to_json(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=float)


class PlotUnavailable(ImportError):
    pass


_NO_MATPLOTLIB = (
    "plots need matplotlib, which is not installed: pip install 'epd[plot]' "
    "(./scripts/setup installs it, and so does ./scripts/setup --serve)"
)


def check_plotting() -> None:
    """Raise PlotUnavailable, naming what to install, when matplotlib is missing (without
    importing it)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable(_NO_MATPLOTLIB)


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(_NO_MATPLOTLIB) from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(results: Sequence, path: str | Path, *, title: str | None = None) -> Path:
    """TTFT CDF, one curve per result (policy), log-x; saved as PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        x = np.sort(r.ttft_ms)
        if len(x) > 20_000:  # thin for plotting; keep the tail exact
            idx = np.unique(
                np.concatenate(
                    [
                        np.linspace(0, len(x) - 1, 10_000).astype(int),
                        np.arange(int(len(x) * 0.99), len(x)),
                    ]
                )
            )
            xs, ys = x[idx], (idx + 1) / len(x)
        else:
            xs, ys = x, np.arange(1, len(x) + 1) / len(x)
        ax.plot(xs, ys, label=f"{r.policy} (p99 {np.percentile(r.ttft_ms, 99):.0f} ms)")
    if results:
        ax.axvline(
            results[0].slo_ms, color="grey", ls="--", lw=0.8, label=f"SLO {results[0].slo_ms:g} ms"
        )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title or "TTFT CDF by routing policy")
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_load_sweep(
    sweep: Mapping[str, Sequence[Mapping]], path: str | Path, *, title: str | None = None
) -> Path:
    """TTFT p50 (dashed) and p99 (solid) vs offered load (fraction of capacity), one colour per
    policy. `sweep`: policy -> list of summaries (each with 'load' and 'ttft_ms')."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (policy, rows) in enumerate(sweep.items()):
        rows = sorted(rows, key=lambda s: s["load"])
        loads = [s["load"] for s in rows]
        color = f"C{k}"
        ax.plot(
            loads, [s["ttft_ms"]["p99"] for s in rows], "-o", color=color, label=f"{policy} p99"
        )
        ax.plot(
            loads,
            [s["ttft_ms"]["p50"] for s in rows],
            "--",
            color=color,
            alpha=0.7,
            label=f"{policy} p50",
        )
    ax.set_yscale("log")
    ax.set_xlabel("offered load (fraction of capacity)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title or "TTFT percentiles vs offered load")
    return _save(plt, fig, path)


def plot_cost_vs_slo(
    rows: Sequence[Mapping], path: str | Path, *, title: str | None = None, slo_ms=None
) -> Path:
    """The cheapest shape's cost against the TTFT SLO (`epd plan --plot`). `rows`: dicts with
    slo_ms, cost and shape ("E:P:D"); cost None: no shape within bounds (marked above the rest)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    met = [r for r in rows if r["cost"] is not None]
    ax.step(
        [r["slo_ms"] for r in met], [r["cost"] for r in met], "-o", where="post", label="cheapest"
    )
    for i, r in enumerate(met):  # each shape where it starts
        if i == 0 or r["shape"] != met[i - 1]["shape"]:
            ax.annotate(
                r["shape"], (r["slo_ms"], r["cost"]), textcoords="offset points", xytext=(4, 6)
            )
    top = max([r["cost"] for r in met], default=1.0) * 1.08
    none = [r["slo_ms"] for r in rows if r["cost"] is None]
    if none:  # as if of infinite cost: above the rest
        ax.plot(none, [top] * len(none), "x", color="C3", label="no shape within bounds")
    if slo_ms is not None:
        ax.axvline(slo_ms, color="grey", ls="--", lw=0.8, label=f"--slo-ms {slo_ms:g}")
    ax.margins(x=0.06, y=0.12)
    ax.set_xlabel("TTFT SLO (ms)")
    ax.set_ylabel("cost (sum of worker prices)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "cheapest shape's cost vs TTFT SLO", fontsize=10)
    return _save(plt, fig, path)
