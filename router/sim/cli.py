"""`epd simulate`: run the routing simulator from the command line.

    epd simulate --cluster 16x16x16-hetero --policy all --workload poisson \\
                 --requests 200000 --load 0.8 --seed 1 --slo-ms 2000 --plot ttft.png

`--cluster`: "ExPxD" (e.g. 16x16x16), "ExPxD-hetero" (half the encoders and prefill
workers at 0.5x speed), "ExPxD-split" (image + video encoders apart from audio ones),
or a YAML file (configs/sim_*.yaml). `--workload`: poisson, bursty, or a JSONL trace
recorded from the live cluster (router/sim/workload.py has the schema). `--load` is the
offered load as a fraction of the cluster's capacity for the workload's request mix (a
trace is time-scaled to it; without --load a trace replays at its recorded pace).
`--rate` offers requests per second instead (the report gives the load fraction it amounts
to; not with --load or --sweep). `--policy all` runs every routing policy on the same
requests. `--sweep 0.5,0.7,0.9` runs every load listed (and, with --plot, also draws TTFT
percentiles vs load next to the CDF).

Exit status 2 with a message naming the problem for bad input: unknown policy, a
cluster shape that does not parse or cannot serve the workload (e.g. no encoder hosts
a modality the workload needs), a workload file that does not parse.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

PROG = "epd simulate"


class UsageError(Exception):
    pass


def _policies(name: str) -> list[str]:
    from router.policies import POLICIES

    if name == "all":
        names = sorted(POLICIES)
        if "joint" in names:
            names.remove("joint")
            names.insert(0, "joint")
        return names
    out = []
    for part in name.split(","):
        part = part.strip()
        if part not in POLICIES:
            raise UsageError(
                f"unknown routing policy {part!r}; known: {', '.join(sorted(POLICIES))} (or 'all')"
            )
        out.append(part)
    return out


def _pairs(text: str, flag: str, what: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, weight = part.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = float(weight)
        except ValueError:
            raise UsageError(
                f"{flag} wants {what}=WEIGHT[,{what}=WEIGHT...], got {part!r}"
            ) from None
    return out


def _mix(text: str | None) -> dict[str, float] | None:
    return _pairs(text, "--mix", "CLASS") if text else None


def _loads(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--sweep wants comma-separated load fractions, got {text!r}") from None
    if not loads or any(not (x > 0 and math.isfinite(x)) for x in loads):
        raise UsageError(f"--sweep loads must be positive numbers, got {text!r}")
    return loads


def _check_rate(rate: float | None) -> None:
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise UsageError(f"--rate must be a positive number of requests/s, got {rate}")


def arrival_rps(workload) -> float:
    """The arrival rate a workload realised: requests after the first over their span."""
    span = float(workload.arrival_s[-1] - workload.arrival_s[0]) if len(workload) > 1 else 0.0
    return (len(workload) - 1) / span if span > 0 else math.inf


def _add_mix_args(p: argparse.ArgumentParser) -> None:
    """The synthetic workloads' flags (`epd simulate` and `epd plan`)."""
    p.add_argument(
        "--mix",
        default=None,
        help="request mix, e.g. text=0.3,image=0.3,images4=0.15,video=0.1,audio=0.15",
    )
    p.add_argument(
        "--repeat-rate",
        type=float,
        default=0.2,
        help="probability a media request reuses recent media",
    )
    p.add_argument(
        "--prefix-share",
        type=float,
        default=0.0,
        help="probability a request starts with a shared prefix",
    )


def _workload(args: argparse.Namespace, default_requests: int):
    """The workload --workload names: synthetic (--requests of them, else `default_requests`),
    or a trace (its first --requests)."""
    from router.sim.trace_file import load_trace
    from router.sim.workload import make_workload

    kind = args.workload
    if kind in ("poisson", "bursty"):
        return make_workload(
            kind,
            args.requests or default_requests,
            mix=_mix(args.mix),
            seed=args.seed,
            repeat_rate=args.repeat_rate,
            prefix_share=args.prefix_share,
        )
    if not Path(kind).exists():
        raise UsageError(
            f"workload {kind!r} is neither 'poisson', 'bursty' nor an existing trace file"
        )
    workload = load_trace(kind)
    return workload if args.requests is None else workload.head(args.requests)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--cluster",
        default="16x16x16",
        help="ExPxD, ExPxD-hetero, ExPxD-split, or a cluster YAML (default 16x16x16)",
    )
    p.add_argument(
        "--policy", default="joint", help="a routing policy, a comma list, or 'all' (default joint)"
    )
    p.add_argument(
        "--workload", default="poisson", help="poisson | bursty | PATH.jsonl (default poisson)"
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests to simulate (default 100000; a trace: all of it unless given)",
    )
    p.add_argument(
        "--load",
        type=float,
        default=None,
        help="offered load as a fraction of capacity (default 0.8; a trace: its own pace)",
    )
    p.add_argument("--sweep", default=None, help="comma-separated loads to run instead of --load")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="offered load in requests/s instead of --load (the report gives both)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--slo-ms", type=float, default=2000.0, help="TTFT SLO for goodput (default 2000)"
    )
    _add_mix_args(p)
    p.add_argument(
        "--json", action="store_true", help="print the results as JSON (no progress bar)"
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="TTFT CDF per policy (and OUT_load.png with --sweep)",
    )
    return p


def run(args: argparse.Namespace, out=None) -> int:
    from router.sim.cluster_model import SimCluster, capacity_rps
    from router.sim.loop import simulate
    from router.sim.report import (
        PlotUnavailable,
        check_plotting,
        format_table,
        plot_load_sweep,
        plot_ttft_cdf,
        to_json,
    )

    out = out or sys.stdout
    if args.plot:  # before any simulating, not after minutes of it
        try:
            check_plotting()
        except PlotUnavailable as exc:
            raise UsageError(f"--plot: {exc}") from None
    policies = _policies(args.policy)
    if args.requests is not None and args.requests < 1:
        raise UsageError(f"--requests must be >= 1, got {args.requests}")
    if args.load is not None and not (args.load > 0 and math.isfinite(args.load)):
        raise UsageError(f"--load must be a positive fraction of capacity, got {args.load}")
    if args.rate is not None and (args.load is not None or args.sweep):
        raise UsageError(
            "--rate (requests/s) and --load/--sweep (fractions of capacity) both set the offered "
            "load: give one of them"
        )
    _check_rate(args.rate)
    if not (args.slo_ms > 0):
        raise UsageError(f"--slo-ms must be > 0, got {args.slo_ms}")
    cluster = SimCluster.parse(args.cluster)

    workload = _workload(args, 100_000)
    default_load = 0.8 if args.workload in ("poisson", "bursty") else None
    cluster.check_workload(workload.modalities())  # before any simulating
    capacity = capacity_rps(cluster, workload)
    if capacity <= 0:
        raise UsageError(f"cluster {cluster.name!r} has no capacity for this workload")

    loads = (
        _loads(args.sweep) if args.sweep else [args.load if args.load is not None else default_load]
    )
    rates = (
        [args.rate]
        if args.rate is not None
        else [None if x is None else x * capacity for x in loads]
    )
    progress = not args.json
    runs: dict[str, list] = {p: [] for p in policies}
    for rate in rates:
        wl = workload if rate is None else workload.at_rate(rate)
        actual_load = wl.rate_rps / capacity
        if not args.json:
            print(
                f"{cluster.describe()}\nworkload {wl.name}: {len(wl)} requests "
                f"at {wl.rate_rps:.2f} req/s "
                f"= {actual_load:.2f} x capacity ({capacity:.2f} req/s); SLO {args.slo_ms:g} ms",
                file=out,
                flush=True,
            )
        for policy in policies:
            runs[policy].append(
                simulate(
                    cluster,
                    wl,
                    policy,
                    seed=args.seed,
                    slo_ms=args.slo_ms,
                    progress=progress,
                    load=actual_load,
                )
            )
        if not args.json:
            print(format_table([runs[p][-1].summary() for p in policies]), file=out, flush=True)

    summaries = {p: [r.summary() for r in rs] for p, rs in runs.items()}
    if args.plot:
        plot = Path(args.plot)
        last = [runs[p][-1] for p in policies]
        plot_ttft_cdf(
            last,
            plot,
            title=f"TTFT CDF, {cluster.name}, load {last[0].load:.2f}" if last[0].load else None,
        )
        written = [plot]
        if args.sweep:
            sweep_path = plot.with_name(plot.stem + "_load" + (plot.suffix or ".png"))
            plot_load_sweep(summaries, sweep_path, title=f"TTFT vs offered load, {cluster.name}")
            written.append(sweep_path)
        if not args.json:
            print("plots: " + ", ".join(str(w) for w in written), file=out)
    if args.json:
        doc = {
            "cluster": cluster.describe(),
            "capacity_rps": round(capacity, 4),
            "workload": workload.name,
            "seed": args.seed,
        }
        if args.rate is not None:  # and the rate the arrivals realised
            doc |= {"rate_rps": args.rate, "arrival_rps": round(arrival_rps(wl), 4)}
        if args.sweep:
            doc["sweep"] = summaries
        else:
            doc["results"] = [s[0] for s in summaries.values()]
        print(to_json(doc), file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for `epd simulate ARGS...` (argv excludes 'simulate')."""
    from router.sim.cluster_model import ClusterShapeError
    from router.sim.workload import WorkloadError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (UsageError, ClusterShapeError, WorkloadError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------------- epd plan

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
    from router.sim.cluster_model import ClusterShapeError
    from router.sim.workload import WorkloadError

    args = build_plan_parser().parse_args(argv)
    try:
        return run_plan(args)
    except (UsageError, ClusterShapeError, WorkloadError) as exc:
        print(f"{PLAN_PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
