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
to; not with --load or --sweep). `--routers N` splits the requests over N ingress replicas'
routers that share their bookings every `--share-ms`, and at once around a request whose
prefill is estimated above `--sync-above-ms`.
`--policy all` runs every routing policy on the same requests. `--sweep 0.5,0.7,0.9` runs
every load listed (and, with --plot, also draws TTFT percentiles vs load next to the CDF).

Exit status 2 with a message naming the problem for bad input: unknown policy, a
cluster shape that does not parse or cannot serve the workload (e.g. no encoder hosts
a modality the workload needs), a workload file that does not parse.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from router.router import SYNC_ABOVE_MS

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
        "--routers",
        type=int,
        default=1,
        help="ingress replicas' routers taking turns, each booking only its own requests "
        "(default 1)",
    )
    p.add_argument(
        "--share-ms",
        type=float,
        default=None,
        help="how often workers report their queues and caches to every router, in ms "
        "(the routers' sharing period; default: the cluster's publish interval)",
    )
    p.add_argument(
        "--sync-above-ms",
        type=float,
        default=SYNC_ABOVE_MS,
        help="with several routers: a request whose prefill is estimated above this (on the "
        "fastest worker) is routed on a fresh share and shared at once, as router.sync_above_ms "
        f"does live (default {SYNC_ABOVE_MS:g}; 0: only every --share-ms)",
    )
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
    if args.routers < 1:
        raise UsageError(f"--routers must be >= 1, got {args.routers}")
    if args.share_ms is not None and not (args.share_ms > 0 and math.isfinite(args.share_ms)):
        raise UsageError(f"--share-ms must be a positive number of ms, got {args.share_ms}")
    if not (args.sync_above_ms >= 0 and math.isfinite(args.sync_above_ms)):
        raise UsageError(f"--sync-above-ms must be 0 or more ms, got {args.sync_above_ms}")
    cluster = SimCluster.parse(args.cluster)
    if args.share_ms is not None:
        cluster = cluster.with_costs(publish_interval_s=args.share_ms / 1e3)

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
                    routers=args.routers,
                    sync_above_ms=args.sync_above_ms,
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
    return run_reporting_errors(PROG, run, build_parser().parse_args(argv))


def run_reporting_errors(prog: str, run_args, args: argparse.Namespace) -> int:
    """`run_args(args)`; bad input (usage, cluster shape, workload) is exit status 2 with a
    message naming the problem."""
    from router.sim.cluster_model import ClusterShapeError
    from router.sim.workload import WorkloadError

    try:
        return run_args(args)
    except (UsageError, ClusterShapeError, WorkloadError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
