"""`epd plan`: the command line of the shape planner (router/sim/plan.py owns the search).
The workload flags and their parsing are `epd simulate`'s own (router/sim/cli.py)."""

from __future__ import annotations

import argparse
import math
import sys

from router.sim.cli import (
    UsageError,
    _add_mix_args,
    _check_rate,
    _pairs,
    _workload,
    run_reporting_errors,
)

PLAN_PROG = "epd plan"
PLAN_DOC = """`epd plan`: the cheapest E:P:D shape (encoder, prefill and decode workers) whose
simulated TTFT at a percentile meets an SLO at a request rate (router/sim/plan.py: the search).

    epd plan --rate 50 --slo-ms 1000 [--percentile 99] [--mix ...] [--workload trace.jsonl]
             [--prices encoder=2,prefill=3,decode=3] [--seed 0] [--json] [--plot cost.png]

Prints the shape, its cost (prices per worker, 1 each by default) and simulated TTFT
percentiles, and the shapes one worker smaller, which miss. A trace (--workload) gives the
request mix and calibrates the stage costs from its measured timings. Exit status 1 when no
shape within --max-workers per stage meets the target, 2 for bad input."""


def build_plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PLAN_PROG, description=PLAN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rate", type=float, required=True, help="arrivals, requests/s")
    p.add_argument("--slo-ms", type=float, required=True, help="TTFT SLO (ms)")
    p.add_argument("--percentile", type=float, default=99.0, help="of TTFT (default 99)")
    p.add_argument(
        "--workload", default="poisson", help="poisson | bursty | PATH.jsonl (default poisson)"
    )
    p.add_argument(
        "--requests", type=int, default=3000, help="per simulation (default 3000; a trace: head)"
    )
    _add_mix_args(p)
    p.add_argument("--prices", default=None, help="per worker, e.g. encoder=2,prefill=3,decode=3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-workers", type=int, default=32, help="per stage (default 32)")
    p.add_argument(
        "--decode-wait-ms",
        type=float,
        default=100.0,
        help="decode target: KV waits for a decode slot at most this at the percentile (100)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="cheapest cost vs SLO")
    p.add_argument("--plot-slos", default=None, help="SLOs (ms) to plot (default around --slo-ms)")
    return p


def _prices(text: str | None) -> dict[str, float]:
    from router.sim.plan import STAGES

    raw = _pairs(text, "--prices", "STAGE") if text else {}
    names = {
        "encoder": "encoders",
        "encoders": "encoders",
        "prefill": "prefill",
        "decode": "decode",
    }
    bad = sorted(set(raw) - set(names))
    if bad or any(not (v > 0 and math.isfinite(v)) for v in raw.values()):
        raise UsageError(f"--prices takes encoder=, prefill=, decode= prices > 0, got {text!r}")
    return {s: 1.0 for s in STAGES} | {names[k]: v for k, v in raw.items()}


def _plot_slos(args: argparse.Namespace) -> list[float]:
    if not args.plot_slos:
        return [round(args.slo_ms * f, 1) for f in (0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 3.0)]
    try:
        slos = [float(x) for x in args.plot_slos.split(",") if x.strip()]
    except ValueError:
        slos = []
    if not slos or any(not (0 < x < math.inf) for x in slos):
        raise UsageError(f"--plot-slos wants comma-separated SLOs in ms, got {args.plot_slos!r}")
    return sorted(slos)


def _planner(args: argparse.Namespace):
    """The workload, the calibrated costs and the Planner of a plan's arguments."""
    from router.sim.cluster_model import SimCosts
    from router.sim.plan import Planner
    from router.sim.trace_file import fit_costs

    for flag, value in (("--slo-ms", args.slo_ms), ("--percentile", args.percentile)):
        if not (0 < value < math.inf) or (flag == "--percentile" and value > 100):
            raise UsageError(f"{flag} out of range: {value}")
    _check_rate(args.rate)
    if args.requests < 1 or args.max_workers < 1:
        raise UsageError("--requests and --max-workers must be >= 1")
    workload = _workload(args, args.requests)
    costs, fitted = SimCosts(), {}
    if args.workload not in ("poisson", "bursty"):
        costs, fitted = fit_costs(args.workload, costs)
    planner = Planner(
        workload,
        args.rate,
        costs=costs,
        prices=_prices(args.prices),
        seed=args.seed,
        max_workers=args.max_workers,
        progress=True,
    )
    return planner, fitted


def _label(planner, args) -> str:
    name = planner.workload.name
    return f"{name} ({args.mix or 'seed mix'})" if name in ("poisson", "bursty") else name


def _plan_row(o, note: str = "") -> str:
    ttft = "".join(f"{v:>{9 if i == 0 else 8}.1f}" for i, v in enumerate(o.ttft_ms.values()))
    return (
        f"{str(o.shape):<8}{o.cost:>6g}{ttft}{o.decode_wait_ms:>10.1f}   "
        f"{note or '; '.join(o.misses())}"
    )


def _print_plan(plan, planner, args, wall_s: float, out) -> None:
    from router.sim.plan import pkey

    p, b = pkey(args.percentile), plan.best
    prices = ", ".join(f"{k} {v:g}" for k, v in planner.prices.items())
    print(
        f"{PLAN_PROG}: {args.rate:g} req/s of {_label(planner, args)}, "
        f"{len(planner.workload)} requests per simulation, seed {args.seed}\n"
        f"target: TTFT {p} <= {args.slo_ms:g} ms, decode-slot wait {p} <= "
        f"{args.decode_wait_ms:g} ms; price per worker: {prices}\n",
        file=out,
    )
    ttft = "".join(f"{k:>8}" for k in b.ttft_ms)
    head = f"{'E:P:D':<8}{'cost':>6} TTFT{ttft[4:]}{'wait ' + p:>10}   (ms)"
    print(head + "\n" + "-" * len(head), file=out)
    util = "/".join(f"{b.utilisation[k]:.2f}" for k in ("encoder", "prefill", "decode"))
    print(_plan_row(b, f"<- the plan (busy E/P/D {util})"), file=out)
    for o in plan.cheaper:
        print(_plan_row(o), file=out)
    for stage, fit in plan.extra["calibrated"].items():
        fit = ", ".join(f"{k} {v:g}" for k, v in fit.items())
        print(f"fitted from the trace, {stage}: {fit}", file=out)
    print(f"{plan.simulations} shapes simulated in {wall_s:.1f} s", file=out)


def run_plan(args: argparse.Namespace, out=None) -> int:
    import time

    from router.sim.cluster_model import SimCluster, capacity_rps
    from router.sim.plan import NoShape, Target
    from router.sim.report import PlotUnavailable, check_plotting, to_json

    out, wall0 = out or sys.stdout, time.perf_counter()
    if args.plot:
        try:
            check_plotting()
        except PlotUnavailable as exc:
            raise UsageError(f"--plot: {exc}") from None
        _plot_slos(args)  # a bad list refused before any simulating
    planner, fitted = _planner(args)
    target = Target(args.slo_ms, args.percentile, args.decode_wait_ms)
    try:
        plan = planner.search(target)
        wall_s = time.perf_counter() - wall0
        if args.plot:
            plan.extra["plot"] = _plot(planner, target, args)
    except NoShape as exc:
        print(f"{PLAN_PROG}: {exc}", file=sys.stderr)
        if exc.closest is not None:
            print(f"closest tried: {_plan_row(exc.closest)}", file=sys.stderr)
        if args.json:
            closest = exc.closest.to_dict() if exc.closest else None
            print(to_json({"error": str(exc), "closest": closest}), file=out)
        return 1
    finally:
        planner.close()
    s = plan.best.shape
    cluster = SimCluster.build(s.encoders, s.prefill, s.decode, costs=planner.costs)
    plan.extra |= {
        "load": round(args.rate / capacity_rps(cluster, planner.workload), 4),
        "requests": len(planner.workload),
        "seed": args.seed,
        "workload": planner.workload.name,
        "prices": planner.prices,
        "calibrated": fitted,
    }
    if args.json:
        print(to_json(plan.to_dict()), file=out)
        return 0
    _print_plan(plan, planner, args, wall_s, out)
    for r in plan.extra.get("plot", {}).get("points", []):
        shape = f"{r['shape']} cost {r['cost']:g}" if r["shape"] else "none within bounds"
        print(f"SLO {r['slo_ms']:g} ms: {shape}", file=out)
    if args.plot:
        print(f"plot: {args.plot}", file=out)
    return 0


def _plot(planner, target, args) -> dict:
    """The cheapest cost for each of several SLOs at the plan's rate, plotted."""
    from dataclasses import replace

    from router.sim.plan import NoShape, pkey
    from router.sim.report import plot_cost_vs_slo

    rows = []
    for slo in _plot_slos(args):
        try:
            best = planner.search(replace(target, slo_ms=slo)).best
            rows.append({"slo_ms": slo, "cost": best.cost, "shape": str(best.shape)})
        except NoShape:
            rows.append({"slo_ms": slo, "cost": None, "shape": None})
    title = (
        f"cheapest E:P:D at {args.rate:g} req/s, {_label(planner, args)}, "
        f"TTFT {pkey(args.percentile)}"
    )
    plot_cost_vs_slo(rows, args.plot, title=title, slo_ms=args.slo_ms)
    return {"path": str(args.plot), "points": rows}


def plan_main(argv: list[str] | None = None) -> int:
    """Entry point for `epd plan ARGS...` (argv excludes 'plan')."""
    return run_reporting_errors(PLAN_PROG, run_plan, build_plan_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(plan_main())
