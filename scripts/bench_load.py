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
import io
import json
import sys
import time
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from benchkit.cpu import CpuWatch
from benchkit.http_client import Result, replay_cluster, sequential_cluster
from benchkit.live_server import served
from benchkit.stats import pct
from benchkit.workload import Req, make_workload
from cluster.config import REPO_ROOT, load_config

# ----------------------------------------------------------------------------- measuring


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


# ----------------------------------------------------------------------------- cluster


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
    cfg = load_config(args.config)
    if args.stream_interval:
        cfg = cfg.replace(decode={"stream_interval": args.stream_interval})
    with served(cfg) as base:
        url, model, max_tokens = f"{base}/chat/completions", cfg.model.served_name, args.max_tokens
        asyncio.run(sequential_cluster(url, warmup, model, max_tokens, "cluster warm-up"))
        with CpuWatch() as idle_watch:
            idle_res = asyncio.run(sequential_cluster(url, idle, model, max_tokens, "cluster idle"))
        with CpuWatch() as watch:
            results, wall = asyncio.run(
                replay_cluster(url, reqs, model, max_tokens, args.concurrency)
            )
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
    config's device and dtype (so on a GPU the cluster is compared with `generate` on that
    GPU)."""

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
        # floats take the model's dtype; ids stay ints
        inputs = inputs.to(self.device, dtype=self.model.dtype)
        with self.torch.inference_mode():
            self.model.generate(
                **inputs, max_new_tokens=self.max_tokens, do_sample=False, streamer=streamer
            )
        return started, streamer.times

    def replay(self, reqs: list[Req], desc: str) -> tuple[list[Result], float]:
        results, t0 = [], time.perf_counter()
        for req in tqdm(reqs, desc=desc, unit="req"):
            # FIFO: a request waits its turn
            time.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
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
    warmup = make_workload(args.warmup, 0.0, 1.0, args.seed + 2)  # own images: cached by content
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
