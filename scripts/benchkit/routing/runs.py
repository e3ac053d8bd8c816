"""The live routing bench's saved runs: their traces joined with the responses' timings,
the rounds saved in an output directory, and each run's live figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from benchkit.routing.config import POLICIES
from benchkit.stats import pcts


def read_trace(path: str) -> list[dict]:
    """A trace file's records in arrival order."""
    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted(recs, key=lambda r: r["arrival_s"])  # load_trace's order (stable sort)


def join(trace: list[dict], timings: list[dict]) -> list[tuple[dict, dict]]:
    """(trace record, response timings) pairs: both carry the same server TTFT (rounded to us)."""
    by_ttft = {r["ttft_ms"]: r for r in trace}
    return [
        (by_ttft[round(t["ttft_ms"], 3)], t) for t in timings if round(t["ttft_ms"], 3) in by_ttft
    ]


def timed_trace(run: dict) -> list[dict]:
    """The run's trace, every record with its measured stage times (a trace written before the
    cluster recorded them gets them from the responses its TTFTs join) and its decode_ms."""
    from router.sim.trace_file import MEASURED_STAGES

    trace = read_trace(run["trace"])
    for t, m in join(trace, run["records"] + run["warm_timings"]):
        for key in MEASURED_STAGES:
            if key in m:  # runs saved before prefill_compute_ms was recorded lack it
                t.setdefault(key, m[key])
        # first token to last: decoding shares the host too (router/sim/variability.py)
        if "e2e_ms" in m:
            t["decode_ms"] = max(m["e2e_ms"] - m["ttft_ms"], 0.0)
    if known := [t["decode_ms"] for t in trace if "decode_ms" in t]:
        for t in trace:  # the capacity probe's requests (not saved): the typical decode
            t.setdefault("decode_ms", float(np.median(known)))
    return trace


def saved_rounds(args) -> list[dict[str, dict]]:
    """The runs saved in --out-dir, per round, each round's policies in the order they ran."""
    out_dir, rounds = Path(args.out_dir), []
    while all((out_dir / f"run_{pol}_r{len(rounds)}.json").exists() for pol in POLICIES):
        k = len(rounds)
        order = POLICIES if k % 2 == 0 else POLICIES[::-1]
        rounds.append(
            {pol: json.loads((out_dir / f"run_{pol}_r{k}.json").read_text()) for pol in order}
        )
    if not rounds:
        sys.exit(f"no saved runs (run_<policy>_r0.json) in {out_dir}")
    return rounds


def live_summary(run: dict) -> dict:
    """A run's live figures: TTFT percentiles, the router's estimate errors, its share of
    requests on the slowed worker, and what the host and the stages did meanwhile."""
    recs = run["records"]
    pairs, slow = join(read_trace(run["trace"]), recs), run.get("slow_prefill", 1)
    # prefill ms a token on the first (unslowed) worker: how slow the host was
    fast = [m["prefill_ms"] / t["num_prompt_tokens"] * 1e3 for t, m in pairs if t["route"][1] == 0]
    return {
        "fast_prefill_ms_per_1k_tokens": round(float(np.median(fast)), 1) if fast else None,
        "client_ttft_ms": pcts([r["client_ttft_ms"] for r in recs]),
        "server_ttft_ms": pcts([r["ttft_ms"] for r in recs]),
        "estimate_abs_error_ms": round(
            float(np.mean([abs(r["estimated_ttft_ms"] - r["ttft_ms"]) for r in recs])), 2
        ),
        "estimate_signed_error_ms": round(
            float(np.mean([r["estimated_ttft_ms"] - r["ttft_ms"] for r in recs])), 2
        ),
        "share_on_slow_prefill": round(
            float(np.mean([t["route"][1] == slow for t, _ in pairs])), 3
        ),
        "wall_s": round(run["wall_s"], 1),
        "capacity_rps": round(run["capacity_rps"], 2),
        "other_cpu_s": round(run["other_cpu_s"], 1),
        "stage_ms": run["stage_ms"],
        "prefill_estimates": prefill_estimates(pairs),
    }


def prefill_estimates(pairs) -> dict | None:
    """Estimated vs measured prefill queue and prefill ms (means), over all load-phase requests
    and over the slowest 5% by client TTFT: is the tail a queue the router did not see coming?"""
    pairs = sorted(
        [(t, m) for t, m in pairs if "estimate_ms" in t], key=lambda p: p[1]["client_ttft_ms"]
    )
    if not pairs:
        return None  # a trace written before the estimate's parts were recorded

    def means(sel):
        return {
            f"{k}_{side}": round(
                float(np.mean([t["estimate_ms"][k] if side == "est" else t[k] for t, _ in sel])), 1
            )
            for k in ("prefill_queue_ms", "prefill_ms")
            for side in ("est", "measured")
        }

    return {"all": means(pairs), "slowest_5pct": means(pairs[-max(1, len(pairs) // 20) :])}
