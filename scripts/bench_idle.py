#!/usr/bin/env python
"""What an idle server costs the host: CPU cores its processes keep busy with no request in
flight, against Ray Serve alone (the same Ray, the same front door, a one-route app).

On a small host that background slows every request's forward: a two-thread forward waits
for a thread the scheduler gave to a daemon's tick (BENCHMARKS, "An idle cluster").

Both phases start a Ray of their own on this host, serve one request first (the server's
state after traffic, not after start), wait `--settle-s`, then count CPU for `--seconds`.
`--forward-threads N` also times the checkpoint's language model on a 256-token prompt in this
process, on N torch threads: before any Ray, beside idle Serve alone and beside idle epd.

Usage: scripts/bench_idle.py [--config configs/local_cpu.yaml] [--seconds 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from benchkit.cpu import CpuWatch, ray_running
from benchkit.live_server import served, wait_for_free_port
from cluster.config import DEFAULT_CONFIG, load_config
from cluster.front_door import controller_options
from cluster.prepare import ensure_model


class Forward:
    """The checkpoint's language model on a fixed 256-token prompt, median ms of `repeats`."""

    def __init__(self, cfg, threads: int):
        import torch
        from transformers import AutoModelForImageTextToText

        torch.set_num_threads(threads)
        model = AutoModelForImageTextToText.from_pretrained(cfg.model.checkpoint_path)
        self.lm = model.model.language_model.eval()
        hidden = model.config.get_text_config().hidden_size
        self.embeds = torch.randn(1, 256, hidden, generator=torch.Generator().manual_seed(0))

    def median_ms(self, repeats: int = 20) -> float:
        import torch

        times = []
        with torch.inference_mode():
            for _ in range(repeats + 2):  # two to warm up
                started = time.perf_counter()
                self.lm(inputs_embeds=self.embeds)
                times.append((time.perf_counter() - started) * 1e3)
        return round(statistics.median(times[2:]), 2)


def idle_cores(settle_s: float, seconds: float, forward: Forward | None) -> dict:
    """Cores busy per process name of this tree over `seconds`, after `settle_s` of quiet;
    then the forward's median beside them."""
    time.sleep(settle_s)
    with CpuWatch() as watch:
        time.sleep(seconds)
    by_process = {
        name: round(cpu_s / seconds, 4)
        for name, cpu_s in watch.by_process.items()
        if cpu_s > 0 and name != "driver (client)"
    }
    out = {"cores": round(sum(by_process.values()), 4), "by_process": by_process}
    return out | ({"forward_ms": forward.median_ms()} if forward else {})


def serve_alone(cfg, settle_s: float, seconds: float, forward: Forward | None) -> dict:
    """Ray and Serve as epd starts them, with a one-route app instead of epd's."""
    import ray
    from ray import serve

    @serve.deployment
    class Hello:
        async def __call__(self, request) -> str:
            return "hello"

    ray.init(num_cpus=cfg.server.num_cpus_ray, include_dashboard=False)
    try:
        serve.start(
            http_options={"host": cfg.server.host, "port": cfg.server.port},
            controller_options=controller_options(cfg.server.front_door),
        )
        serve.run(Hello.bind(), name="hello", route_prefix="/")
        httpx.get(f"http://{cfg.server.host}:{cfg.server.port}/", timeout=30).raise_for_status()
        return idle_cores(settle_s, seconds, forward)
    finally:
        serve.shutdown()
        ray.shutdown()


def epd_idle(cfg, settle_s: float, seconds: float, forward: Forward | None) -> dict:
    with served(cfg) as base:
        body = {
            "model": cfg.model.served_name,
            "messages": [{"role": "user", "content": "Say one word."}],
            "max_tokens": 2,
        }
        httpx.post(f"{base}/chat/completions", json=body, timeout=120).raise_for_status()
        return idle_cores(settle_s, seconds, forward)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--seconds", type=float, default=30.0, help="how long CPU is counted")
    p.add_argument("--settle-s", type=float, default=10.0, help="quiet before counting")
    p.add_argument("--forward-threads", type=int, default=0, help="0: no forward timed")
    p.add_argument("--out", default="/tmp/bench_idle.json")
    args = p.parse_args(argv)
    cfg = ensure_model(load_config(args.config))
    if ray_running():
        sys.exit("a Ray cluster is already running on this host; stop it before benchmarking")
    forward = Forward(cfg, args.forward_threads) if args.forward_threads else None
    report: dict = {"config": args.config, "seconds": args.seconds}
    if forward:
        report["forward_alone_ms"] = forward.median_ms()
    report["serve_alone"] = serve_alone(cfg, args.settle_s, args.seconds, forward)
    wait_for_free_port(cfg.server.port, within_s=15.0)
    report["epd"] = epd_idle(cfg, args.settle_s, args.seconds, forward)
    report["epd_over_serve_alone_cores"] = round(
        report["epd"]["cores"] - report["serve_alone"]["cores"], 4
    )
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
