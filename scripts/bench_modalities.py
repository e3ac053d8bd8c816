#!/usr/bin/env python
"""Mixed-modality benchmark on the all-modality model (bench-omni, configs/bench_omni_cpu.yaml).

In one run, on one deployment:
1. Text-only TTFT with and without video: Poisson text requests alone, then the same text
   arrivals with 30-frame video requests mixed in (20% of all requests); phases alternate
   `--rounds` times and the ratio of medians is reported (this host is noisy).
2. The seed mix (text, one image, four images, 30-frame video, 30 s audio; weights from
   router.sim.workload.DEFAULT_MIX): TTFT per request class.
3. Encoder throughput, items/s, per modality: one encoder actor at batch size 1 against
   one at the configured batch size, the same items submitted at once to each.
4. Multi-turn with the same image: turn 2 repeats turn 1's prompt and image, adds a reply
   and a question; TTFT of each turn (one conversation at a time) and the prefill
   workers' prefix hit rate over turn 2 (from /metrics).
Writes JSON (docs/BENCHMARKS.md has the procedure and figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from benchkit.cpu import CpuWatch
from benchkit.http_client import stream_one
from benchkit.live_server import served
from benchkit.media import VIDEO_FPS, audio_part, image_part, video_part
from benchkit.modality_mix import replay, workload
from benchkit.server_metrics import pauses_for_short
from benchkit.stats import pct, tail_phases
from cluster.config import REPO_ROOT, load_config
from router.sim.workload import DEFAULT_MIX

# ----------------------------------------------------------------------------- phases


def mixed_kinds(num_text: int, seed: int) -> list[str]:
    """`num_text` text requests and a quarter as many videos (20% of all), shuffled."""
    kinds = ["text"] * num_text + ["video"] * (num_text // 4)
    random.Random(seed).shuffle(kinds)
    return kinds


def mixed_capacity_rps(url: str, model: str, args) -> float:
    """Requests/s the cluster completes of the 80/20 text/video mix, all sent at once:
    the burst's size over the time until its last request finished (a lower bound, as the
    burst's head and tail leave workers idle)."""
    kinds = mixed_kinds(args.capacity_text_requests, 7)
    burst = workload(kinds, 1e9, 7, model, args.max_tokens)  # arrivals 1 ns apart: at once
    started = time.perf_counter()
    asyncio.run(replay(url, burst, "capacity: the mix at once"))
    return len(kinds) / (time.perf_counter() - started)


def text_vs_video(url: str, model: str, args) -> dict:
    """Text TTFT alone vs with 20% video requests, alternating rounds on the same server.
    With `--load-fraction`, the mixed phase is offered that fraction of the mix's measured
    capacity (the text-alone phase keeps the same text arrivals, so 80% of that rate)."""
    capacity = mixed_capacity_rps(url, model, args) if args.load_fraction else None
    text_rate = capacity * args.load_fraction / 1.25 if capacity else args.text_rate
    rounds = []
    for r in range(args.rounds):
        texts, mixed = ["text"] * args.text_requests, mixed_kinds(args.text_requests, r)
        alone_timings: dict[str, list[dict]] = {}
        alone = asyncio.run(
            replay(
                url,
                workload(texts, text_rate, 100 + r, model, args.max_tokens),
                f"round {r}: text only",
                alone_timings,
            )
        )
        mixed_timings: dict[str, list[dict]] = {}
        with_video = asyncio.run(
            replay(
                url,
                workload(mixed, text_rate * 1.25, 100 + r, model, args.max_tokens),
                f"round {r}: text + 20% video",
                mixed_timings,
            )
        )
        rounds.append(
            {
                "text_alone_ms": alone["text"],
                "text_with_video_ms": with_video["text"],
                "video_ms": with_video.get("video", []),
                "text_tail_phases": tail_phases(with_video["text"], mixed_timings["text"]),
                # where the median text's time went, alone and beside video (all texts)
                "text_phases_p50_alone": tail_phases(alone["text"], alone_timings["text"], 1.0),
                "text_phases_p50_with_video": tail_phases(
                    with_video["text"], mixed_timings["text"], 1.0
                ),
            }
        )
    stat = lambda key, q: float(np.median([pct(rd[key], q) for rd in rounds]))
    out = {
        f"{key}_p{q}": stat(key, q)
        for key in ("text_alone_ms", "text_with_video_ms", "video_ms")
        for q in (50, 99)
    }
    out |= {
        "mixed_capacity_rps": capacity,
        "load_fraction": args.load_fraction,
        "text_rate_rps": text_rate,
        "mixed_rate_rps": text_rate * 1.25,
    }
    out["ratio_p50"] = out["text_with_video_ms_p50"] / out["text_alone_ms_p50"]
    out["ratio_p99"] = out["text_with_video_ms_p99"] / out["text_alone_ms_p99"]
    out["rounds"] = [
        {k: v if isinstance(v, dict) else [round(x, 1) for x in v] for k, v in rd.items()}
        for rd in rounds
    ]
    out["node_priority"] = pauses_for_short(url.rsplit("/v1", 1)[0])  # since the server started
    return out


def seed_mix(url: str, model: str, args) -> dict:
    rnd = random.Random(7)
    kinds = rnd.choices(list(DEFAULT_MIX), weights=list(DEFAULT_MIX.values()), k=args.mix_requests)
    ttft = asyncio.run(
        replay(url, workload(kinds, args.mix_rate, 7, model, args.max_tokens), "seed mix")
    )
    return {
        kind: {"n": len(v), "ttft_p50_ms": pct(v, 50), "ttft_p99_ms": pct(v, 99)}
        for kind, v in sorted(ttft.items())
    }


def encoder_throughput(cfg, args) -> dict:
    """Items/s of one encoder actor at batch 1 vs at the configured batch size."""
    import ray

    from actors.encoder import EncoderActor
    from actors.runtime import WorkerSpec
    from actors.types import EncodeJob
    from cluster.prompt_plan import PromptPlanner
    from router.worker_settings import EncoderSettings

    planner, pool = PromptPlanner(cfg.model.checkpoint_path), cfg.encoder_pools[0]
    spec = WorkerSpec(
        str(cfg.model.checkpoint_path),
        cfg.model.resolved_dtype,
        cfg.model.device,
        pool.torch_threads,
        cfg.model.max_model_len,
    )
    items = sample_items(planner, args)
    out = {}
    for batch in (1, pool.max_batch_size):
        settings = EncoderSettings(batch, pool.max_wait_ms, cache_mb=0.0)
        actor = EncoderActor.options(num_cpus=0).remote(spec, settings)
        ray.get(actor.ready.remote())
        for modality, group in items.items():
            jobs = [
                EncodeJob(f"bench-{i}", item, planner.spec.num_embeddings(item))
                for i, item in enumerate(group)
            ]
            ray.get([actor.encode.remote(job) for job in jobs[:1]])  # warm-up
            started = time.perf_counter()
            ray.get([actor.encode.remote(job) for job in jobs])
            out.setdefault(modality, {})[f"batch_{batch}_items_per_s"] = len(jobs) / (
                time.perf_counter() - started
            )
        ray.kill(actor)
    for row in out.values():
        row["ratio"] = row[f"batch_{pool.max_batch_size}_items_per_s"] / row["batch_1_items_per_s"]
    return out


def sample_items(planner, args) -> dict:
    """Decoded items as the ingress would hand them over (distinct, so no cache hits)."""
    from cluster.config import LimitsConfig
    from cluster.media.decoders import MediaOptions
    from cluster.media.load import load_media_item
    from cluster.media.video import VideoSampling
    from router.types import Modality

    rng, limits = np.random.default_rng(3), LimitsConfig()
    options = MediaOptions(
        audio_sample_rate_hz=planner.spec.audio_sample_rate_hz,
        video_sampling=VideoSampling(fps=VIDEO_FPS, max_frames=32),
    )
    make = {
        Modality.IMAGE: (image_part, "image_url", 16),
        Modality.VIDEO: (video_part, "video_url", 4),
        Modality.AUDIO: (audio_part, "input_audio", 8),
    }
    items = {}
    for modality, (part, key, n) in make.items():
        payloads = [part(rng)[key] for _ in range(n)]
        items[modality.value] = [
            load_media_item(
                modality,
                p.get("url") or p["data"],
                namespace="bench",
                limits=limits,
                param="x",
                format=p.get("format"),
                options=options,
            )
            for p in payloads
        ]
    return items


def prefix_tokens(base_url: str) -> dict[str, float]:
    """Prompt tokens found in the prefix cache (hit) and computed (miss), from the ingress's
    /metrics."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    total = lambda name: sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)
    )
    hits, queries = total("epd:prefix_cache_hits_total"), total("epd:prefix_cache_queries_total")
    return {"hit": hits, "miss": queries - hits}


def multi_turn(url: str, model: str, args) -> dict:
    """Turn-2 TTFT vs turn 1 on the same image, and turn 2's prefix hit rate."""
    rng, base = np.random.default_rng(11), url.removesuffix("/chat/completions")
    body = lambda messages: json.dumps(
        {
            "model": model,
            "messages": messages,
            "temperature": 0,
            "max_tokens": args.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()

    async def run() -> tuple[list[float], list[float], dict]:
        turn1, turn2, hits = [], [], {"hit": 0.0, "miss": 0.0}
        async with httpx.AsyncClient(timeout=600) as client:
            for i in tqdm(range(args.conversations), desc="multi-turn", unit="conv"):
                first = [
                    {
                        "role": "user",
                        "content": [
                            image_part(rng),
                            {"type": "text", "text": f"What is in this picture, case {i}?"},
                        ],
                    }
                ]
                turn1.append(
                    (await stream_one(client, url, body(first), 0.0, time.perf_counter())).ttft_s
                    * 1e3
                )
                # A fixed reply stands in for the answer: the prefix turn 2 shares is turn 1's
                # whole prompt either way.
                second = first + [
                    {"role": "assistant", "content": "A picture of coloured noise."},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "Which colour is most common?"}],
                    },
                ]
                before = prefix_tokens(base)
                turn2.append(
                    (await stream_one(client, url, body(second), 0.0, time.perf_counter())).ttft_s
                    * 1e3
                )
                after = prefix_tokens(base)
                for r in hits:
                    hits[r] += after[r] - before[r]
        return turn1, turn2, hits

    turn1, turn2, hits = asyncio.run(run())
    return {
        "turn1_ttft_p50_ms": pct(turn1, 50),
        "turn2_ttft_p50_ms": pct(turn2, 50),
        "ratio_p50": pct(turn2, 50) / pct(turn1, 50),
        "turn2_prefix_hit_rate": hits["hit"] / max(hits["hit"] + hits["miss"], 1.0),
        "turn1_ms": [round(x, 1) for x in turn1],
        "turn2_ms": [round(x, 1) for x in turn2],
    }


# ----------------------------------------------------------------------------- main


def summary(value):
    """The report without its per-request lists (those are in --out): what fits a terminal."""
    if isinstance(value, dict):
        return {k: summary(v) for k, v in value.items() if k != "args" and not _samples(v)}
    return [summary(v) for v in value] if isinstance(value, list) else value


def _samples(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], (int, float))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO_ROOT / "configs" / "bench_omni_cpu.yaml"))
    p.add_argument("--text-requests", type=int, default=40, help="text requests per phase")
    p.add_argument("--text-rate", type=float, default=2.0, help="text requests per second")
    p.add_argument(
        "--load-fraction",
        type=float,
        help=(
            "offer the text+video phase this fraction of the mix's measured capacity "
            "(overrides --text-rate)"
        ),
    )
    p.add_argument(
        "--capacity-text-requests",
        type=int,
        default=16,
        help="capacity probe: text requests (plus a quarter as many videos)",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mix-requests", type=int, default=40)
    p.add_argument("--mix-rate", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--conversations", type=int, default=10, help="multi-turn: conversations, one at a time"
    )
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["text_vs_video", "seed_mix", "encoder_throughput", "multi_turn"],
    )
    p.add_argument("--out", default="/tmp/bench_modalities.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config)
    report = {"config": args.config, "args": vars(args)}
    with served(cfg) as base:
        url = f"{base}/chat/completions"
        asyncio.run(
            replay(
                url,
                workload(["text", "image", "video", "audio"], 100.0, 1, cfg.model.served_name, 4),
                "warm-up",
            )
        )
        phases = {
            "text_vs_video": lambda: text_vs_video(url, cfg.model.served_name, args),
            "seed_mix": lambda: seed_mix(url, cfg.model.served_name, args),
            "encoder_throughput": lambda: encoder_throughput(cfg, args),
            "multi_turn": lambda: multi_turn(url, cfg.model.served_name, args),
        }
        for name, phase in phases.items():
            if name in args.skip:
                continue
            with CpuWatch() as watch:
                report[name] = phase()
            report[f"{name}_other_cpu_s"] = watch.other_cpu_s
            Path(args.out).write_text(
                json.dumps(report, indent=2)
            )  # each phase kept even if a later one fails
    print(json.dumps(summary(report), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
