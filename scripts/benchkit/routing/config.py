"""The live routing bench's command line and the fleet it describes: 2 encoders, N prefill
workers (the last one slowed), 1 decode worker, one routing policy per fleet."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from cluster.config import builtin_model, load_config

POLICIES = ("least_loaded", "joint")


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """The live bench's command line (bench_routing_replay parses its saved runs' with it)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "epd_routing_live"))
    p.add_argument(
        "--config",
        default=None,
        help="base config (default: local_cpu.yaml with the random-weight tiny-llava)",
    )
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=2,
        help="prefill workers; the last one is the slowed one",
    )
    p.add_argument(
        "--slowdown", type=float, default=4.0, help="the last prefill worker's slowdown factor S"
    )
    p.add_argument(
        "--stretch",
        type=float,
        default=1.0,
        help="every prefill worker's device time x this (sleep: emulates accelerators, whose work "
        "dominates the serving overhead and is not shared between workers)",
    )
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument(
        "--rate",
        type=float,
        default=7.0,
        help="req/s to offer; 0: --load x the first fleet's measured capacity",
    )
    p.add_argument(
        "--load",
        type=float,
        default=0.75,
        help="with --rate 0: fraction of the measured capacity to offer",
    )
    p.add_argument("--image-fraction", type=float, default=0.5)
    p.add_argument(
        "--words",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=(40, 550),
        help="filler words per prompt, MIN,MAX (~2.1 tokens each: prefill dominates the stage "
        "costs)",
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--concurrency", type=int, default=64, help="most requests in flight (bench_load's cap)"
    )
    p.add_argument("--probe-requests", type=int, default=60)
    p.add_argument("--probe-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="ingress replicas (server.num_replicas), each routing with its own router",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of both policies, alternating which goes first",
    )
    p.add_argument(
        "--sim-seeds",
        type=int,
        default=5,
        help="noise seeds per simulator replay (results averaged)",
    )
    p.add_argument(
        "--analyze",
        action="store_true",
        help="no live runs: redo the tables from the runs saved in --out-dir",
    )
    return p.parse_args(argv)


def slowdowns(args) -> list[float]:
    """Per prefill worker: every one stretched alike, and one deliberately slowed worker, the
    last."""
    return [args.stretch] * (args.prefill_workers - 1) + [args.stretch * args.slowdown]


def base_config(args):
    """--config, else the default config with tiny-llava, the model the recorded runs used."""
    return (
        load_config(args.config)
        if args.config
        else load_config().replace(model=builtin_model("tiny-llava"))
    )


def cluster_config(args, policy: str, trace: Path):
    """The fleet of one phase: `policy`, its trace written to `trace`."""
    return base_config(args).replace(
        encoder={"num_workers": 2},
        prefill={"num_workers": args.prefill_workers, "slowdown": slowdowns(args)},
        decode={"num_workers": 1},
        router={"policy": policy},
        server={"port": args.port, "trace_path": str(trace), "num_replicas": args.replicas},
    )
