"""The live routing bench's report: per round, the policies' live TTFT, their ratio and the
simulator against the measurement; over all rounds, the ratios and errors per round."""

from __future__ import annotations

import json
import statistics

from benchkit.routing.config import POLICIES
from benchkit.routing.runs import live_summary
from benchkit.routing.sim import MODELS, validate_sim


def round_summary(runs: dict[str, dict], args) -> dict:
    live = {pol: live_summary(run) for pol, run in runs.items()}
    ll, jt = live["least_loaded"]["client_ttft_ms"], live["joint"]["client_ttft_ms"]
    ratios = {k: round(jt[k] / ll[k], 3) for k in ("p50", "p90", "p99")}
    return {
        "order": list(runs),
        "live": live,
        "ratios": ratios | {"target_met": ratios["p99"] <= 0.70},
        "simulator": validate_sim(runs["joint"], args),
    }


LIVE_COLUMNS = "   server p99  |est-meas|  on slow  other CPU-s  fast ms/1k tok"
SIM_ROWS = (
    ("  variable model", "variable"),
    ("  + measured host", "measured host"),
    ("  deterministic", "deterministic"),
    ("  measured service", "measured_service_variant"),
)


def print_round(k: int, s: dict) -> None:
    print(f"\n== round {k} ({' then '.join(s['order'])})")
    print_live(s)
    r = s["ratios"]
    print(
        f"joint / least_loaded: p50 {r['p50']:.2f}  p90 {r['p90']:.2f}  p99 {r['p99']:.2f}   "
        f"(target p99 <= 0.70: {'met' if r['target_met'] else 'NOT met'})"
    )
    print_simulator(s["simulator"])


def print_live(s: dict) -> None:
    """Per policy: client TTFT percentiles and what the run measured besides."""
    print(f"{'TTFT ms (client)':<22}{'p50':>8}{'p90':>8}{'p99':>8}{'mean':>8}" + LIVE_COLUMNS)
    for pol in POLICIES:
        c, l = s["live"][pol]["client_ttft_ms"], s["live"][pol]
        print(
            f"{pol:<22}{c['p50']:>8.1f}{c['p90']:>8.1f}{c['p99']:>8.1f}{c['mean']:>8.1f}   "
            f"{l['server_ttft_ms']['p99']:>10.1f}"
            f"{l['estimate_abs_error_ms']:>11.1f}{l['share_on_slow_prefill']:>9.0%}"
            f"{l['other_cpu_s']:>11.1f}"
            f"{l['fast_prefill_ms_per_1k_tokens'] or float('nan'):>15.1f}"
        )


def print_simulator(v: dict) -> None:
    """Measured vs simulated TTFT mean and p90, server and client side, per calibration."""
    print(
        f"{'simulator vs measured':<22}{'mean':>8}{'p90':>8}   rel. error mean / p90   "
        f"({v['requests_compared']} requests)"
    )
    for side in ("server", "client"):
        m = v["variable"][side]["measured"]
        print(f"{'measured ' + side:<22}{m['mean']:>8.1f}{m['p90']:>8.1f}")
        for name, key in SIM_ROWS:
            x = v[key][side]
            sim, e = x["simulated"], x["rel_error"]
            print(
                f"{name:<22}{sim['mean']:>8.1f}{sim['p90']:>8.1f}   "
                f"{e['mean']:+.1%} / {e['p90']:+.1%}"
                f"   ({'within' if x['within_20pct'] else 'NOT within'} 20%)"
            )
    print("variable model calibration:", json.dumps(v["variable"]["calibration"]))


def print_overall(rounds: list[dict]) -> None:
    p99 = [r["ratios"]["p99"] for r in rounds]
    print(
        f"\njoint / least_loaded client p99 per round: {', '.join(f'{x:.2f}' for x in p99)}; "
        f"median {statistics.median(p99):.2f} "
        f"(target <= 0.70: met in {sum(x <= 0.70 for x in p99)} of {len(p99)})"
    )
    for model in MODELS[:2]:
        for side in ("server", "client"):
            errs = [r["simulator"][model][side]["rel_error"] for r in rounds]
            print(
                f"simulator ({side}, {model}) mean / p90 error per round: "
                + ", ".join(f"{e['mean']:+.0%} / {e['p90']:+.0%}" for e in errs)
            )
