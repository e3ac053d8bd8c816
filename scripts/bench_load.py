#!/usr/bin/env python
"""Load benchmark: the E/P/D cluster vs a single-process HF baseline on one workload.

Replays N requests (Poisson arrivals, single-image and text-only prompts, temperature 0)
against the cluster (streaming SSE) and against one process running
`LlavaForConditionalGeneration.generate` FIFO with 1 and with 2 torch threads, and
measures idle single-image TTFT. Prints a table and writes JSON (docs/BENCHMARKS.md).
TTFT counts from a request's scheduled arrival, so queueing in either system is in it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cluster.config import REPO_ROOT, load_config  # noqa: E402

SUBJECTS = "a red car|the old bridge|two cats|a quiet lake|the tall tree|a small boat|the city at night|a green field".split(
    "|"
)
ASKS = [
    "Describe {s}.",
    "What is near {s}?",
    "Write one sentence about {s}.",
    "Tell me a story about {s}.",
    "What color is {s}?",
    "Why would someone paint {s}?",
]


@dataclass
class Req:
    idx: int
    arrival_s: float
    prompt: str
    png: bytes | None  # None: a text-only request


@dataclass
class Result:
    ttft_s: float
    tpot_s: float | None
    tokens: int
    first_s: float  # first and last token times, relative to the phase start
    done_s: float
    timings: dict | None = None


# ----------------------------------------------------------------------------- workload


def make_png(rng: random.Random) -> bytes:
    """Random noise or a colour gradient, 128..512 px a side."""
    w, h = rng.randint(128, 512), rng.randint(128, 512)
    nprng = np.random.default_rng(rng.randrange(2**32))
    if rng.random() < 0.5:
        arr = nprng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    else:
        gy, gx = np.mgrid[0:h, 0:w]
        c = nprng.uniform(0.2, 1.0, 3)
        arr = (((gx / w)[..., None] * c + (gy / h)[..., None] * (1 - c)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def make_workload(n: int, rate: float, image_fraction: float, seed: int) -> list[Req]:
    """Poisson arrivals at `rate`; rate 0 gives all-image requests at t=0 (idle TTFT)."""
    rng, t, reqs = random.Random(seed), 0.0, []
    for i in range(n):
        png = make_png(rng) if rate == 0 or rng.random() < image_fraction else None
        reqs.append(Req(i, t, rng.choice(ASKS).format(s=rng.choice(SUBJECTS)), png))
        t += rng.expovariate(rate) if rate else 0.0
    return reqs


# ----------------------------------------------------------------------------- measuring


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[Result], wall_s: float) -> dict:
    ttft, tpot = (
        [r.ttft_s * 1e3 for r in results],
        [r.tpot_s * 1e3 for r in results if r.tpot_s is not None],
    )
    out = {f"ttft_p{q}_ms": pct(ttft, q) for q in (50, 90, 99)} | {
        f"tpot_p{q}_ms": pct(tpot, q) for q in (50, 90, 99)
    }
    tokens = sum(r.tokens for r in results)
    return out | {
        "requests": len(results),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "requests_per_s": len(results) / wall_s,
        "decode_concurrency_mean": sum(r.done_s - r.first_s for r in results) / wall_s,
    }


def procs() -> dict[int, tuple[str, int, float]]:
    """pid -> (name, parent pid, CPU seconds incl. reaped children), from /proc."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").glob("[0-9]*"):
        try:
            name, rest = (d / "stat").read_text()[:-1].split(" (", 1)[1].rsplit(") ", 1)
            f = rest.split()
            out[int(d.name)] = (name, int(f[1]), sum(int(x) for x in f[11:15]) / tick)
        except (OSError, IndexError, ValueError):
            continue
    return out


class CpuWatch:
    """CPU seconds per process name in this process tree (Ray's raylet, GCS and workers
    descend from this driver), and what processes outside it used meanwhile: other work
    on the host skews every figure, so it is recorded and warned about."""

    def __enter__(self):
        self.start = self._snapshot()
        return self

    def __exit__(self, *exc):
        end = self._snapshot()
        self.other_cpu_s = max(0.0, end.pop("<other>") - self.start.pop("<other>"))
        used = {k: round(v - self.start.get(k, 0.0), 2) for k, v in end.items()}
        self.by_process = dict(sorted(used.items(), key=lambda kv: -kv[1]))
        if self.other_cpu_s > 2.0:
            print(
                f"warning: other processes used {self.other_cpu_s:.1f} CPU-s during this phase",
                file=sys.stderr,
            )

    @staticmethod
    def _snapshot() -> dict[str, float]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        busy = sum(fields[i] for i in (0, 1, 2, 5, 6)) / os.sysconf(
            "SC_CLK_TCK"
        )  # user nice system irq softirq
        table, tree, frontier = procs(), {os.getpid()}, [os.getpid()]
        while frontier:
            kids = [
                pid
                for pid, (_, ppid, _) in table.items()
                if ppid == frontier[-1] and pid not in tree
            ]
            frontier = frontier[:-1] + kids
            tree.update(kids)
        out = {}
        for pid in tree & table.keys():
            name = "driver (client)" if pid == os.getpid() else table[pid][0]
            out[name] = out.get(name, 0.0) + table[pid][2]
        return out | {"<other>": busy - sum(out.values())}


# ----------------------------------------------------------------------------- cluster


def chat_body(req: Req, model: str, max_tokens: int) -> bytes:
    content = [{"type": "text", "text": req.prompt}]
    if req.png is not None:
        url = "data:image/png;base64," + base64.b64encode(req.png).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


async def stream_one(client, url: str, body: bytes, arrival: float, t0: float) -> Result:
    first = last = None
    usage, timings = {}, None
    async with client.stream(
        "POST", url, content=body, headers={"content-type": "application/json"}
    ) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event, now = json.loads(line[6:]), time.perf_counter()
            if "error" in event:
                raise RuntimeError(f"server error: {event['error']}")
            choice = (event.get("choices") or [{}])[0]
            if choice.get("delta", {}).get("content") or choice.get("finish_reason"):
                first, last = first or now, now
            usage, timings = event.get("usage") or usage, event.get("timings") or timings
    n = usage.get("completion_tokens", 0)
    return Result(
        first - (t0 + arrival),
        (last - first) / (n - 1) if n > 1 else None,
        n,
        first - t0,
        last - t0,
        timings,
    )


async def replay_cluster(url: str, reqs: list[Req], model: str, args) -> tuple[list[Result], float]:
    bodies = [chat_body(r, model, args.max_tokens) for r in reqs]
    sem, bar = (
        asyncio.Semaphore(args.concurrency),
        tqdm(total=len(reqs), desc="cluster load", unit="req"),
    )
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(req: Req, body: bytes) -> Result:
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
            async with sem:  # a request the cap holds back counts that wait in its TTFT
                result = await stream_one(client, url, body, req.arrival_s, t0)
            bar.update()
            return result

        results = await asyncio.gather(*(one(r, b) for r, b in zip(reqs, bodies)))
    bar.close()
    return list(results), max(r.done_s for r in results)


async def sequential_cluster(
    url: str, reqs: list[Req], model: str, args, desc: str
) -> list[Result]:
    """One request at a time, nothing else in flight (warm-up and idle TTFT)."""
    async with httpx.AsyncClient(timeout=300) as client:
        return [
            await stream_one(
                client, url, chat_body(r, model, args.max_tokens), 0.0, time.perf_counter()
            )
            for r in tqdm(reqs, desc=desc, unit="req")
        ]


def server_profile(results: list[Result]) -> dict:
    """Medians of the server's own `timings` (image requests only for encode_ms)."""
    ts = [r.timings for r in results if r.timings]
    out = {
        f"{k}_p50": pct([t[k] for t in ts if k in t], 50)
        for k in ("ttft_ms", "prefill_queue_ms", "prefill_ms")
    }
    return out | {
        "encode_ms_p50_images": pct([t["encode_ms"] for t in ts if t.get("encode_ms")], 50)
    }


def run_cluster(args, reqs: list[Req], idle: list[Req], warmup: list[Req]) -> dict:
    import ray
    from ray import serve

    from cluster.cli import start
    from cluster.prepare import ensure_model

    cfg = load_config(args.config)
    if args.stream_interval:
        cfg = cfg.replace(decode={"stream_interval": args.stream_interval})
    ensure_model(cfg)
    if any(
        name in ("raylet", "gcs_server") for name, _, _ in procs().values()
    ):  # `ray status` misses token-auth ones
        sys.exit(
            "a Ray cluster is already running on this host; wait for it to stop before benchmarking"
        )
    base = start(cfg)
    url, model = f"{base}/chat/completions", cfg.model.served_name
    try:
        asyncio.run(sequential_cluster(url, warmup, model, args, "cluster warm-up"))
        with CpuWatch() as idle_watch:
            idle_res = asyncio.run(sequential_cluster(url, idle, model, args, "cluster idle"))
        with CpuWatch() as watch:
            results, wall = asyncio.run(replay_cluster(url, reqs, model, args))
    finally:
        serve.shutdown()
        ray.shutdown()
    return summarize(results, wall) | {
        "idle_ttft_p50_ms": pct([r.ttft_s * 1e3 for r in idle_res], 50),
        "other_cpu_s": watch.other_cpu_s + idle_watch.other_cpu_s,
        "cpu_s_by_process_load": watch.by_process,
        "server_profile_load": server_profile(results),
        "server_profile_idle": server_profile(idle_res),
    }


# ----------------------------------------------------------------------------- baseline


class Baseline:
    """One process, one request at a time: PNG decode, preprocessing, `generate`, on the
    config's device and dtype (so on a GPU the cluster is compared with `generate` on that GPU)."""

    def __init__(
        self, checkpoint: Path, max_tokens: int, *, device: str = "cpu", dtype: str = "float32"
    ):
        import torch
        from transformers import AutoProcessor, LlavaForConditionalGeneration
        from transformers.generation.streamers import BaseStreamer

        class TimingStreamer(BaseStreamer):
            """Timestamps every generated token; the first put() is the prompt and is skipped."""

            def __init__(self):
                self.prompt_seen, self.times = False, []

            def put(self, value):
                if self.prompt_seen:
                    self.times.append(time.perf_counter())
                self.prompt_seen = True

            def end(self):
                pass

        self.torch, self.max_tokens, self.streamer_cls, self.device = (
            torch,
            max_tokens,
            TimingStreamer,
            device,
        )
        self.model = (
            LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
            .to(device)
            .eval()
        )
        self.processor = AutoProcessor.from_pretrained(checkpoint)

    def serve(self, req: Req) -> tuple[float, list[float]]:
        """Start time and per-token timestamps."""
        started, content, images = time.perf_counter(), [{"type": "text", "text": req.prompt}], None
        if req.png is not None:
            content.insert(0, {"type": "image"})
            images = [Image.open(io.BytesIO(req.png)).convert("RGB")]
        text = self.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        inputs, streamer = (
            self.processor(images=images, text=text, return_tensors="pt"),
            self.streamer_cls(),
        )
        inputs = inputs.to(
            self.device, dtype=self.model.dtype
        )  # floats take the model's dtype; ids stay ints
        with self.torch.inference_mode():
            self.model.generate(
                **inputs, max_new_tokens=self.max_tokens, do_sample=False, streamer=streamer
            )
        return started, streamer.times

    def replay(self, reqs: list[Req], desc: str) -> tuple[list[Result], float]:
        results, t0 = [], time.perf_counter()
        for req in tqdm(reqs, desc=desc, unit="req"):
            time.sleep(
                max(0.0, t0 + req.arrival_s - time.perf_counter())
            )  # FIFO: a request waits its turn
            _, ts = self.serve(req)
            tpot = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else None
            results.append(
                Result(ts[0] - (t0 + req.arrival_s), tpot, len(ts), ts[0] - t0, ts[-1] - t0)
            )
        return results, max(r.done_s for r in results)


def run_baselines(args, reqs: list[Req], idle: list[Req], warmup: list[Req]) -> dict:
    model = load_config(args.config).model
    base, out = (
        Baseline(
            model.checkpoint_path, args.max_tokens, device=model.device, dtype=model.resolved_dtype
        ),
        {},
    )
    for threads in args.baseline_threads:
        base.torch.set_num_threads(threads)
        for req in warmup:
            base.serve(req)
        with CpuWatch() as watch:
            idle_ms = [
                (ts[0] - t) * 1e3
                for t, ts in map(base.serve, tqdm(idle, desc=f"baseline {threads}t idle"))
            ]
            results, wall = base.replay(reqs, f"baseline {threads}t load")
        out[f"baseline_{threads}t"] = summarize(results, wall) | {
            "idle_ttft_p50_ms": pct(idle_ms, 50),
            "other_cpu_s": watch.other_cpu_s,
        }
    return out


# ----------------------------------------------------------------------------- report


def ratios(report: dict) -> dict:
    """Against the faster baseline: by throughput for the load figures, by idle TTFT for idle."""
    c, names = report["cluster"], [k for k in report if k.startswith("baseline_")]
    load = max(names, key=lambda k: report[k]["tokens_per_s"])
    idle = min(names, key=lambda k: report[k]["idle_ttft_p50_ms"])
    r = {
        "load_baseline": load,
        "idle_baseline": idle,
        "throughput_ratio": c["tokens_per_s"] / report[load]["tokens_per_s"],
        "p50_ttft_ratio": c["ttft_p50_ms"] / report[load]["ttft_p50_ms"],
        "idle_ttft_ratio": c["idle_ttft_p50_ms"] / report[idle]["idle_ttft_p50_ms"],
    }
    r["idle_ttft_ratio_vs_load_baseline"] = c["idle_ttft_p50_ms"] / report[load]["idle_ttft_p50_ms"]
    return r | {
        "target_throughput_met": r["throughput_ratio"] >= 1.5 and r["p50_ttft_ratio"] <= 1.0,
        "target_idle_ttft_met": r["idle_ttft_ratio"] <= 1.25,
        "host_quiet": all(report[k]["other_cpu_s"] < 3.0 for k in names + ["cluster"]),
    }


def print_table(report: dict) -> None:
    cols = [
        ("ttft_p50_ms", "TTFT p50"),
        ("ttft_p90_ms", "p90"),
        ("ttft_p99_ms", "p99"),
        ("tpot_p50_ms", "TPOT p50"),
        ("tpot_p90_ms", "p90"),
        ("tpot_p99_ms", "p99"),
        ("tokens_per_s", "tok/s"),
        ("requests_per_s", "req/s"),
        ("idle_ttft_p50_ms", "idle TTFT"),
        ("wall_s", "wall s"),
        ("other_cpu_s", "other CPU"),
    ]
    print(
        "\n" + f"{'system':<12}" + "".join(f"{h:>10}" for _, h in cols) + "   (ms; tok/s, req/s, s)"
    )
    for name in [k for k in report if k == "cluster" or k.startswith("baseline_")]:
        print(
            f"{name:<12}"
            + "".join(
                f"{report[name][k]:>10.1f}" if report[name].get(k) is not None else f"{'-':>10}"
                for k, _ in cols
            )
        )
    print("\nratios:", json.dumps(report.get("ratios", {}), indent=1))
    print("cluster, server-side under load:", json.dumps(report["cluster"]["server_profile_load"]))
    print("cluster, server-side idle:", json.dumps(report["cluster"]["server_profile_idle"]))
    print(
        "cluster, CPU-s by process under load:",
        json.dumps(report["cluster"]["cpu_s_by_process_load"]),
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO_ROOT / "configs" / "bench_cpu.yaml"))
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=5.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--image-fraction", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--concurrency", type=int, default=64, help="most requests in flight at the cluster"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--idle-requests",
        type=int,
        default=8,
        help="sequential single-image requests for idle TTFT",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--baseline-threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2]
    )
    p.add_argument("--skip-baseline", action="store_true", help="cluster only (tuning runs)")
    p.add_argument(
        "--stream-interval",
        type=int,
        help="override the config's decode.stream_interval (tokens per streamed chunk)",
    )
    p.add_argument("--out", default="bench_load.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    reqs = make_workload(args.num_requests, args.rate, args.image_fraction, args.seed)
    idle = make_workload(args.idle_requests, 0.0, 1.0, args.seed + 1)
    warmup = make_workload(
        args.warmup, 0.0, 1.0, args.seed + 2
    )  # own images: the encoder caches by content
    report = {
        "args": vars(args),
        "workload": {
            "requests": len(reqs),
            "images": sum(r.png is not None for r in reqs),
            "arrival_span_s": reqs[-1].arrival_s,
        },
    }
    report["cluster"] = run_cluster(args, reqs, idle, warmup)
    if not args.skip_baseline:
        report |= run_baselines(args, reqs, idle, warmup)
        report["ratios"] = ratios(report)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
