#!/usr/bin/env python
"""Load benchmark: the E/P/D cluster vs a single-process HF baseline on one workload.

Replays N requests (Poisson arrivals, a mix of single-image and text-only prompts,
temperature 0) against the cluster (streaming SSE) and against one process that runs
`LlavaForConditionalGeneration.generate` FIFO, with 1 and with 2 torch threads. Also
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
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cluster.config import REPO_ROOT, load_config  # noqa: E402

SUBJECTS = "a red car|the old bridge|two cats|a quiet lake|the tall tree|a small boat|the city at night|a green field".split("|")
ASKS = ["Describe {s}.", "What is near {s}?", "Write one sentence about {s}.", "Tell me a story about {s}.",
        "What color is {s}?", "Why would someone paint {s}?"]


@dataclass
class Req:
    idx: int
    arrival_s: float
    prompt: str
    png: bytes | None


@dataclass
class Result:
    ttft_s: float
    tpot_s: float | None
    tokens: int
    done_s: float  # completion time, relative to the phase start
    timings: dict | None = None


def make_png(rng: random.Random) -> bytes:
    w, h = rng.randint(128, 512), rng.randint(128, 512)
    nprng = np.random.default_rng(rng.randrange(2**32))
    if rng.random() < 0.5:
        arr = nprng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    else:
        gy, gx = np.mgrid[0:h, 0:w]
        c = nprng.uniform(0.2, 1.0, 3)
        arr = (((gx / w)[..., None] * c + (gy / h)[..., None] * (1 - c)) * 127.5).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def make_prompt(rng: random.Random) -> str:
    return rng.choice(ASKS).format(s=rng.choice(SUBJECTS))


def make_workload(n: int, rate: float, image_fraction: float, seed: int) -> list[Req]:
    rng, t, reqs = random.Random(seed), 0.0, []
    for i in range(n):
        png = make_png(rng) if rng.random() < image_fraction else None
        reqs.append(Req(i, t, make_prompt(rng), png))
        t += rng.expovariate(rate)
    return reqs


def idle_workload(k: int, seed: int) -> list[Req]:
    rng = random.Random(seed + 1)
    return [Req(i, 0.0, make_prompt(rng), make_png(rng)) for i in range(k)]


def warmup_reqs(idle: list[Req], n: int) -> list[Req]:
    return (idle[:1] + [Req(0, 0.0, "Hello there.", None)] * n)[:n]


def machine_load() -> float:
    """1-minute load average; other work on the host skews every figure, so it is recorded."""
    load = os.getloadavg()[0]
    if load > 1.0:
        print(f"warning: load average {load:.1f} before this phase; figures will be skewed", file=sys.stderr)
    return load


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[Result], wall_s: float) -> dict:
    ttft = [r.ttft_s * 1e3 for r in results]
    tpot = [r.tpot_s * 1e3 for r in results if r.tpot_s is not None]
    tokens = sum(r.tokens for r in results)
    out = {f"ttft_p{q}_ms": pct(ttft, q) for q in (50, 90, 99)}
    out.update({f"tpot_p{q}_ms": pct(tpot, q) for q in (50, 90, 99)})
    out.update(requests=len(results), completion_tokens=tokens, wall_s=wall_s,
               tokens_per_s=tokens / wall_s, requests_per_s=len(results) / wall_s)
    return out


# ----------------------------------------------------------------------------- cluster

def chat_body(req: Req, model: str, max_tokens: int) -> bytes:
    content = [{"type": "text", "text": req.prompt}]
    if req.png is not None:
        url = "data:image/png;base64," + base64.b64encode(req.png).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
                       "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}).encode()


async def stream_one(client, url: str, body: bytes, arrival: float, t0: float) -> Result:
    first = last = None
    usage, timings = {}, None
    async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as resp:
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
    tpot = (last - first) / (n - 1) if n > 1 else None
    return Result(first - (t0 + arrival), tpot, n, last - t0, timings)


async def replay_cluster(url: str, reqs: list[Req], model: str, args, desc: str) -> tuple[list[Result], float]:
    import httpx

    bodies = [chat_body(r, model, args.max_tokens) for r in reqs]
    sem, bar = asyncio.Semaphore(args.concurrency), tqdm(total=len(reqs), desc=desc, unit="req")
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(req: Req, body: bytes) -> Result:
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
            async with sem:
                result = await stream_one(client, url, body, req.arrival_s, t0)
            bar.update()
            return result

        results = await asyncio.gather(*(one(r, b) for r, b in zip(reqs, bodies)))
    bar.close()
    return list(results), max(r.done_s for r in results)


async def sequential_cluster(url: str, reqs: list[Req], model: str, args, desc: str) -> list[Result]:
    """One request at a time, nothing else in flight (warm-up and idle TTFT)."""
    import httpx

    async with httpx.AsyncClient(timeout=300) as client:
        return [await stream_one(client, url, chat_body(r, model, args.max_tokens), 0.0, time.perf_counter())
                for r in tqdm(reqs, desc=desc, unit="req")]


def server_profile(results: list[Result]) -> dict:
    keys = ("ttft_ms", "encode_ms", "prefill_queue_ms", "prefill_ms")
    with_t = [r.timings for r in results if r.timings]
    out = {f"{k}_p50": pct([t[k] for t in with_t if k in t], 50) for k in keys}
    img = [t for t in with_t if t.get("encode_ms")]
    out["encode_ms_p50_images"] = pct([t["encode_ms"] for t in img], 50)
    return out


def scrape(base: str) -> dict[str, float]:
    """Sums and counts of the decode-step and encoder-batch histograms from GET /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_sum", "_count")) and s.labels.get("stage", "decode_step") == "decode_step":
                out[s.name] = s.value
    return out


def step_profile(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps, items = d.get("epd_stage_latency_seconds_count", 0), d.get("epd_encoder_batch_size_count", 0)
    return {"decode_steps": steps, "decode_step_mean_ms": 1e3 * d.get("epd_stage_latency_seconds_sum", 0) / max(steps, 1),
            "encoder_batches": items, "encoder_batch_mean": d.get("epd_encoder_batch_size_sum", 0) / max(items, 1)}


def run_cluster(args, reqs: list[Req], idle: list[Req]) -> dict:
    import ray
    from ray import serve

    from cluster.cli import ensure_model, start

    cfg = load_config(args.config)
    ensure_model(cfg)
    if subprocess.run([str(Path(sys.executable).parent / "ray"), "status"], capture_output=True).returncode == 0:
        sys.exit("a Ray cluster is already running; stop it (or wait) before benchmarking")
    base = start(cfg)
    url, model = f"{base}/chat/completions", cfg.model.served_name
    try:
        asyncio.run(sequential_cluster(url, warmup_reqs(idle, args.warmup), model, args, "cluster warm-up"))
        idle_res = asyncio.run(sequential_cluster(url, idle, model, args, "cluster idle"))
        before, load_avg = scrape(base), machine_load()
        results, wall = asyncio.run(replay_cluster(url, reqs, model, args, "cluster load"))
        steps = step_profile(before, scrape(base))
    finally:
        serve.shutdown()
        ray.shutdown()
    out = summarize(results, wall)
    out["idle_ttft_p50_ms"] = pct([r.ttft_s * 1e3 for r in idle_res], 50)
    out["server_profile_load"], out["server_profile_idle"] = server_profile(results), server_profile(idle_res)
    out["server_profile_load"].update(steps)
    out["load_avg_before"] = load_avg
    return out


# ----------------------------------------------------------------------------- baseline

def make_streamer_cls():
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

    return TimingStreamer


class Baseline:
    def __init__(self, checkpoint: Path, max_tokens: int):
        import torch
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        self.torch, self.max_tokens = torch, max_tokens
        self.model = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
        self.processor = AutoProcessor.from_pretrained(checkpoint)
        self.streamer_cls = make_streamer_cls()

    def serve(self, req: Req) -> tuple[float, list[float]]:
        """Start time and per-token timestamps; includes PNG decode and preprocessing."""
        started = time.perf_counter()
        content = [{"type": "text", "text": req.prompt}]
        images = None
        if req.png is not None:
            content.insert(0, {"type": "image"})
            images = [Image.open(io.BytesIO(req.png)).convert("RGB")]
        text = self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = self.processor(images=images, text=text, return_tensors="pt")
        streamer = self.streamer_cls()
        with self.torch.inference_mode():
            self.model.generate(**inputs, max_new_tokens=self.max_tokens, do_sample=False, streamer=streamer)
        return started, streamer.times

    def replay(self, reqs: list[Req], desc: str) -> tuple[list[Result], float]:
        results, t0 = [], time.perf_counter()
        for req in tqdm(reqs, desc=desc, unit="req"):
            time.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))  # FIFO, one at a time
            _, times = self.serve(req)
            n = len(times)
            tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
            results.append(Result(times[0] - (t0 + req.arrival_s), tpot, n, times[-1] - t0))
        return results, max(r.done_s for r in results)

    def idle_ttft(self, reqs: list[Req], desc: str) -> list[float]:
        out = []
        for req in tqdm(reqs, desc=desc, unit="req"):
            started, times = self.serve(req)
            out.append((times[0] - started) * 1e3)
        return out


def run_baselines(args, reqs: list[Req], idle: list[Req]) -> dict:
    cfg = load_config(args.config)
    base = Baseline(cfg.model.checkpoint_path, args.max_tokens)
    out = {}
    for threads in args.baseline_threads:
        base.torch.set_num_threads(threads)
        for req in warmup_reqs(idle, args.warmup):
            base.serve(req)
        idle_ms = base.idle_ttft(idle, f"baseline {threads}t idle")
        load_avg = machine_load()
        results, wall = base.replay(reqs, f"baseline {threads}t load")
        out[f"baseline_{threads}t"] = {**summarize(results, wall), "idle_ttft_p50_ms": pct(idle_ms, 50), "load_avg_before": load_avg}
    return out


# ----------------------------------------------------------------------------- report

def ratios(report: dict) -> dict:
    c = report["cluster"]
    name = max((k for k in report if k.startswith("baseline_")), key=lambda k: report[k]["tokens_per_s"])
    b = report[name]
    r = {"best_baseline": name, "throughput_ratio": c["tokens_per_s"] / b["tokens_per_s"],
         "p50_ttft_ratio": c["ttft_p50_ms"] / b["ttft_p50_ms"],
         "idle_ttft_ratio": c["idle_ttft_p50_ms"] / b["idle_ttft_p50_ms"]}
    r["target_throughput_met"] = r["throughput_ratio"] >= 1.5 and r["p50_ttft_ratio"] <= 1.0
    r["target_idle_ttft_met"] = r["idle_ttft_ratio"] <= 1.25
    return r


def print_table(report: dict) -> None:
    cols = [("ttft_p50_ms", "TTFT p50"), ("ttft_p90_ms", "p90"), ("ttft_p99_ms", "p99"), ("tpot_p50_ms", "TPOT p50"),
            ("tpot_p90_ms", "p90"), ("tpot_p99_ms", "p99"), ("tokens_per_s", "tok/s"), ("requests_per_s", "req/s"),
            ("idle_ttft_p50_ms", "idle TTFT"), ("wall_s", "wall s")]
    print("\n" + f"{'system':<12}" + "".join(f"{h:>10}" for _, h in cols) + "   (ms unless noted)")
    for name in [k for k in report if k == "cluster" or k.startswith("baseline_")]:
        row = report[name]
        print(f"{name:<12}" + "".join(f"{row[k]:>10.1f}" if row.get(k) is not None else f"{'-':>10}" for k, _ in cols))
    print("\nratios:", json.dumps(report["ratios"], indent=1))
    print("cluster server-side p50s under load:", json.dumps(report["cluster"]["server_profile_load"]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO_ROOT / "configs" / "bench_cpu.yaml"))
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=3.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--image-fraction", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=64, help="most requests in flight at the cluster")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-requests", type=int, default=8, help="sequential single-image requests for idle TTFT")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--baseline-threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--skip-baseline", action="store_true", help="cluster only (tuning runs)")
    p.add_argument("--out", default="bench_load.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    reqs = make_workload(args.num_requests, args.rate, args.image_fraction, args.seed)
    idle = idle_workload(args.idle_requests, args.seed)
    report = {"args": vars(args), "workload": {"images": sum(r.png is not None for r in reqs),
                                                "arrival_span_s": reqs[-1].arrival_s}}
    report["cluster"] = run_cluster(args, reqs, idle)
    if not args.skip_baseline:
        report.update(run_baselines(args, reqs, idle))
        report["ratios"] = ratios(report)
    Path(args.out).write_text(json.dumps(report, indent=2))
    if "ratios" in report:
        print_table(report)
    else:
        print(json.dumps(report["cluster"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
