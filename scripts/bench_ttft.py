#!/usr/bin/env python
"""Where an idle request's time to first token goes, phase by phase, against the checkpoint's
own processor + `generate(max_new_tokens=1)` in one process on the same image and prompt.

Three kinds of request, one at a time on an idle server: a single-image request (a new image
each time), a text request, and a cache-hit repeat (the same image and prompt again: encoder
and prefix caches). For each: the client's TTFT (a bare-socket client, benchkit/raw_client.py,
that parses nothing per event) and the medians of the server's `timings`
(admit = body read + parse + media decode + plan, route, encode queue and compute, transfer,
prefill call = prefill queue + forward + the first token's hand-back in the worker
(prefill_publish) + the hops, first_token = its way out), the
framework's share: server TTFT minus encode and prefill compute, and the wait from the first
token to the second (`second_token_ms`: the KV's hand-over to decode and its first step).
The baseline runs before the server starts and after it stops (this host drifts over
minutes); its median over both windows is the ratio's, each window's beside it. With
`--beside-streams N`, text requests again while N decode streams loop (`text_beside_decode`,
with p90s; with `--beside-kinds text image`, new images too: `image_beside_decode`):
admission's phases under an event loop busy streaming tokens.

Usage: scripts/bench_ttft.py [--config configs/local_cpu.yaml] [--repeats 10]
       [--beside-streams 32 [--beside-kinds text image]]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from benchkit.decode_http import run_streams
from benchkit.http_client import Result, chat_body
from benchkit.live_server import add_front_door_flag, served, with_front_door
from benchkit.raw_client import RawChat
from benchkit.stats import TTFT_PHASES, pct
from benchkit.workload import Req, make_png
from cluster.config import DEFAULT_CONFIG, load_config
from cluster.prepare import ensure_model


def requests(kind: str, repeats: int, seed: int) -> list[Req]:
    rng = random.Random(seed)
    if kind == "text":
        return [Req(i, 0.0, f"Write one sentence about boat {i}.", None) for i in range(repeats)]
    if kind == "repeat":
        png = make_png(rng)
        return [Req(i, 0.0, "Describe this picture.", png) for i in range(repeats)]
    return [Req(i, 0.0, f"Describe picture {i}.", make_png(rng)) for i in range(repeats)]


def one_by_one(url: str, model: str, reqs: list[Req], gap_s: float = 0.0) -> list[Result]:
    """Each request after the last one's end (and `gap_s`), over one kept-alive connection."""
    client, out = RawChat(url), []
    try:
        for req in reqs:
            out.append(client.stream(chat_body(req, model, 2)))
            time.sleep(gap_s)
    finally:
        client.close()
    return out


def breakdown(results: list[Result]) -> dict:
    """Client TTFT and the server's phases, medians in ms, and what the framework adds."""
    med = lambda xs: round(statistics.median(xs), 2)  # noqa: E731
    timings = [r.timings for r in results]
    out = {"client_ttft_ms": med([r.ttft_s * 1e3 for r in results])}
    out["server_ttft_ms"] = med([t["ttft_ms"] for t in timings])
    out |= {f"{p}_ms": med([t.get(f"{p}_ms", 0.0) for t in timings]) for p in TTFT_PHASES}
    framework = [t["ttft_ms"] - t["encode_compute_ms"] - t["prefill_compute_ms"] for t in timings]
    out["framework_ms"] = med(framework)
    out["client_minus_server_ms"] = med(
        [r.ttft_s * 1e3 - t["ttft_ms"] for r, t in zip(results, timings)]
    )
    # each request asks for two tokens: the second one's wait is the hand-over to decode
    gaps = [r.tpot_s * 1e3 for r in results if r.tpot_s is not None]
    out["second_token_ms"] = med(gaps) if gaps else None
    return out


def beside_decode(url: str, model: str, reqs: list[Req], streams: int) -> dict:
    """The requests' breakdown (and p90s) while `streams` decode streams loop, and the
    streams' own TPOT meanwhile (what the requests' priority costs decode)."""
    stop, streamed = threading.Event(), []

    def loop_streams():
        while not stop.is_set():
            streamed.extend(asyncio.run(run_streams(url, model, streams, 64)))

    looping = threading.Thread(target=loop_streams, daemon=True)
    looping.start()
    time.sleep(2.0)  # the streams are decoding

    try:
        results = one_by_one(url, model, reqs, gap_s=0.3)
    finally:
        stop.set()
        looping.join()
    p90 = lambda xs: round(pct(xs, 90), 2)  # noqa: E731
    tpots_ms = [r.tpot_s * 1e3 for r in streamed if r.tpot_s is not None]
    return breakdown(results) | {
        "streams_beside": streams,
        "streams_tpot_ms_p50": round(pct(tpots_ms, 50), 2) if tpots_ms else None,
        "client_ttft_ms_p90": p90([r.ttft_s * 1e3 for r in results]),
        "admit_ms_p90": p90([r.timings["admit_ms"] for r in results]),
        "plan_ms_p90": p90([r.timings["plan_ms"] for r in results]),
    }


class Generate:
    """The baseline: the checkpoint's processor + generate(max_new_tokens=1) in this process."""

    def __init__(self, cfg, threads: int):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        torch.set_num_threads(threads)
        self.cfg, path = cfg, cfg.model.checkpoint_path
        dtype = getattr(torch, cfg.model.resolved_dtype)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
        self.model = self.model.to(cfg.model.device)
        self.processor = AutoProcessor.from_pretrained(path)

    def ttfts_ms(self, reqs: list[Req]) -> list[float]:
        """Each request's ms to its first token, the first one a warm-up left out."""
        return [self._one(req) for req in [reqs[0], *reqs]][1:]

    def _one(self, req: Req) -> float:
        import torch
        from PIL import Image

        started = time.perf_counter()
        content = [{"type": "text", "text": req.prompt}]
        images = None
        if req.png is not None:
            content.insert(0, {"type": "image"})
            images = [Image.open(io.BytesIO(req.png)).convert("RGB")]
        text = self.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        inputs = self.processor(images=images, text=text, return_tensors="pt")
        inputs = inputs.to(self.cfg.model.device, dtype=self.model.dtype)
        with torch.inference_mode():
            self.model.generate(**inputs, max_new_tokens=1, do_sample=False)
        if self.cfg.model.device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default="/tmp/bench_ttft.json")
    p.add_argument(
        "--beside-streams", type=int, default=0, help="text again beside this many streams"
    )
    p.add_argument(
        "--beside-kinds",
        nargs="+",
        choices=("text", "image"),
        default=["text"],
        help="which requests run again beside the streams (new images each time for image)",
    )
    add_front_door_flag(p)
    args = p.parse_args(argv)
    cfg = with_front_door(ensure_model(load_config(args.config)), args.front_door)
    kinds = {k: requests(k, args.repeats, args.seed) for k in ("image", "text", "repeat")}
    report: dict = {"config": args.config, "front_door": cfg.server.front_door.value}
    # The baseline before the server starts and after it stops: this host drifts over minutes
    # (generate's own idle image 6.9-12.3 ms between runs), and the two windows bracket it.
    generate = Generate(cfg, cfg.prefill.idle_torch_threads or cfg.prefill.torch_threads)
    before = {kind: generate.ttfts_ms(kinds[kind]) for kind in ("image", "text")}
    with served(cfg) as base:
        url, model = f"{base}/chat/completions", cfg.model.served_name
        one_by_one(url, model, requests("image", 3, args.seed + 1))  # warm-up
        for kind, reqs in kinds.items():
            report[kind] = breakdown(one_by_one(url, model, reqs))
        for kind in args.beside_kinds if args.beside_streams else ():
            again = requests(kind, max(args.repeats, 40), args.seed + 2)
            report[f"{kind}_beside_decode"] = beside_decode(url, model, again, args.beside_streams)
    for kind in ("image", "text"):
        after = generate.ttfts_ms(kinds[kind])
        base_ms = statistics.median(before[kind] + after)
        report[kind] |= {
            "generate_ttft_ms": round(base_ms, 2),  # over both windows
            "generate_ttft_ms_before": round(statistics.median(before[kind]), 2),
            "generate_ttft_ms_after": round(statistics.median(after), 2),
            "ratio_vs_generate": round(report[kind]["client_ttft_ms"] / base_ms, 2),
        }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
