#!/usr/bin/env python
"""Hardening probe against a RUNNING epd server: one request must never harm another,
bounded media memory, nothing leaks, back-pressure, retries instead of lost requests.

    python scripts/probe_server.py --url http://127.0.0.1:8000 [--phases bad,burst,kill,disconnect]
        [--burst 200] [--timeout 30] [--kill-kinds encoder,prefill,decode] [--kill-ingress]
        [--json out.json]

Phases: bad (raw bad-input cases), burst (N concurrent requests), media (concurrent
requests with several large images each: ingress RSS before / peak / after), kill (SIGKILL one
worker of each kind mid-traffic; --kill-ingress also the ingress replica), disconnect (clients
drop streams; worker state must drain). RSS of the ingress and every worker is sampled
every 0.2 s throughout. Only the given (loopback) URL is contacted; every loop is bounded.
Helpers, in scripts/benchkit/: probe_cases.py (the bad-input bodies), probe_client.py (one
request, classified), rss.py (pids and RSS), probe_faults.py (the kill and disconnect
phases), probe_report.py (results and tables).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from tqdm import tqdm

from benchkit import probe_cases as pc
from benchkit import raw_burst
from benchkit.probe_client import TextTiming, chat_body, gather_bar, is_openai_error, run_chat
from benchkit.probe_faults import phase_disconnect, phase_kill
from benchkit.probe_report import BadRow, PhaseResult, count, print_phase, print_summary
from benchkit.rss import KINDS, RssSampler
from benchkit.stats import pct

# ----------------------------------------------------------------------------- phases


async def phase_bad(ctx) -> PhaseResult:
    result, takes = PhaseResult("bad"), await detect_modalities(ctx)
    canaries, harmed = 0, []
    for i, case in enumerate(tqdm(pc.all_cases(ctx.model), desc="bad", unit="case")):
        row = await send_case(ctx, case)
        row.applies = case.modality is None or case.modality in takes
        result.rows.append(row)
        # every 5th case and after every failure: still serving?
        if i % 5 == 4 or (row.status or 500) >= 500:
            canaries += 1
            if not (await run_chat(ctx.client, ctx.url, chat_body(ctx.model), ctx.timeout)).ok:
                harmed.append(case.name)
    statuses = [r.status or 0 for r in result.rows]
    result.cases, result.hangs = len(statuses), statuses.count(0)
    result.n2xx, result.n4xx = (
        sum(200 <= s < 300 for s in statuses),
        sum(400 <= s < 500 for s in statuses),
    )
    result.n5xx = sum(s >= 500 for s in statuses)
    names = lambda pred: ", ".join(r.case for r in result.rows if pred(r)) or "none"  # noqa: E731
    result.note = (
        f"model takes {','.join(sorted(takes))}; canaries failed {len(harmed)}/{canaries} "
        f"(after: {', '.join(harmed) or 'none'}); "
        f"5xx/hang: {names(lambda r: (r.status or 500) >= 500)}; "
        f"not OpenAI-shaped: {names(lambda r: (r.status or 0) >= 400 and not r.openai_shape)}"
    )
    return result


async def detect_modalities(ctx) -> set[str]:
    takes = set()
    for modality, body in pc.valid_media_cases(ctx.model).items():
        row = await send_case(ctx, pc.Case(f"valid_{modality}", body))
        takes |= {modality} if row.status == 200 else set()
    return takes


async def send_case(ctx, case: pc.Case) -> BadRow:
    t0 = time.perf_counter()
    try:
        resp = await ctx.client.post(
            f"{ctx.url}/v1/chat/completions",
            content=case.body,
            headers={"content-type": case.content_type},
        )
        status, text = resp.status_code, resp.text
    except httpx.TimeoutException:
        status, text = None, "HANG: no answer within --timeout"
    except httpx.HTTPError as exc:
        status, text = None, f"connection error: {exc!r}"
    ms, shaped = (time.perf_counter() - t0) * 1e3, is_openai_error(text)
    message = json.loads(text)["error"]["message"] if shaped else text
    if status == 200:  # the body is a completion, not worth printing
        message = "(SSE stream)" if text.startswith("data:") else "(completion)"
    return BadRow(
        case.name, case.modality, True, status, shaped, ms, " ".join(message.split())[:70]
    )


async def phase_burst(ctx) -> PhaseResult:
    """N requests at once, each on its own raw socket: times are from each request's last byte
    sent (a client library on the server's cores would add its own seconds to a 429's)."""
    result, where = PhaseResult("burst"), urlsplit(ctx.url)
    outcomes = await raw_burst.burst(
        where.port or 80, ctx.model, ctx.args.burst, ctx.timeout, where.hostname
    )
    summary = raw_burst.report(outcomes)
    served_s = [o.first_byte_ms / 1e3 for o in outcomes if o.status == 200]
    result.cases, result.n2xx, result.n5xx = len(outcomes), summary["served"], summary["5xx"]
    result.n4xx = sum(400 <= o.status < 500 for o in outcomes)
    result.hangs = result.lost = summary["no_answer"]
    result.rows = [summary | {"p50_s": pct(served_s, 50), "p99_s": pct(served_s, 99)}]
    result.note = " ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.rows[0].items()
    )
    return result


async def _text_ttfts(url: str, model: str, timeout: float, stop, count: int = 0) -> list:
    """One-token text requests (with one token, each one's latency is its time to first
    token): `count` one after another, or (0) one every 0.2 s until `stop` is set."""
    out: list[TextTiming] = []
    async with httpx.AsyncClient(timeout=timeout) as client:
        while len(out) < count if count else not stop.is_set():
            body = pc.chat(model, f"Say hi to number {len(out)}.", max_tokens=1)
            t0 = time.perf_counter()
            resp = await client.post(f"{url}/v1/chat/completions", json=body)
            latency_ms = (time.perf_counter() - t0) * 1e3
            timings = resp.json().get("timings", {}) if resp.status_code == 200 else {}
            out.append(
                TextTiming(latency_ms, timings.get("e2e_ms", 0.0), timings.get("handover_ms", 0.0))
            )
            if not count:
                await asyncio.sleep(0.2)
    return out


def _tail(timings: list[TextTiming]) -> dict[str, float]:
    """Where the slowest tenth of the text requests spent their time, medians in ms."""
    slowest = sorted(timings, key=lambda t: t.latency_ms)[-max(1, len(timings) // 10) :]
    return {
        "tail_before_server_ms": pct([t.before_server_ms for t in slowest], 50),
        "tail_handover_ms": pct([t.handover_ms for t in slowest], 50),
        "tail_server_ms": pct([t.e2e_ms for t in slowest], 50),
    }


def _text_client(url: str, model: str, timeout: float, stop, results) -> None:
    """A text user of its own (a process: the media uploads' client must not delay it): five
    requests at idle, then requests until the uploads are done."""
    results.put(asyncio.run(_text_ttfts(url, model, timeout, stop, count=5)))
    results.put(asyncio.run(_text_ttfts(url, model, timeout, stop)))


async def phase_media(ctx) -> PhaseResult:
    """Concurrent requests each carrying several large images: does the ingress's memory come
    back, and does text wait behind their decoding?"""
    result, a = PhaseResult("media"), ctx.args
    spawn = multiprocessing.get_context("spawn")
    stop, results = spawn.Event(), spawn.Queue()
    texter = spawn.Process(
        target=_text_client, args=(ctx.url, ctx.model, ctx.timeout, stop, results)
    )
    texter.start()
    idle_timings = await asyncio.to_thread(results.get)
    idle = [t.latency_ms for t in idle_timings]
    images = [pc.photo_jpeg(a.media_megapixels, seed=i) for i in range(a.media_images)]
    bodies = [
        pc.chat(
            ctx.model,
            [
                *(pc.image_part(img, "image/jpeg") for img in images),
                {"type": "text", "text": f"Describe picture set {i}."},
            ],
            max_tokens=4,
        )
        for i in range(a.media_burst)
    ]
    media = await gather_bar(
        [run_chat(ctx.client, ctx.url, b, ctx.timeout) for b in bodies], "media"
    )
    stop.set()
    beside_timings = await asyncio.to_thread(results.get)
    beside = [t.latency_ms for t in beside_timings]
    texter.join()
    count(result, media)
    text = {"idle_p50_ms": pct(idle, 50), "beside_p50_ms": pct(beside, 50)}
    text |= {
        "beside_p90_ms": pct(beside, 90),
        "beside_p99_ms": pct(beside, 99),
        "p99_over_idle": pct(beside, 99) / pct(idle, 50),
    } | _tail(beside_timings)
    for status in (200, 429):  # when the uploads learned their answer, in s
        took = [o.latency_s for o in media if o.status == status]
        if took:
            text |= {f"media_{status}_p50_s": pct(took, 50), f"media_{status}_max_s": max(took)}
    result.rows = [text]
    result.note = (
        f"{a.media_burst} requests x {a.media_images} x {a.media_megapixels:g} MP JPEG; "
        f"{len(beside)} one-token text requests (TTFT) beside, from a process of their own: "
        + " ".join(f"{k}={v:.1f}" for k, v in text.items())
    )
    await asyncio.sleep(2.0)  # let the ingress settle before the 'after' sample
    return result


# ----------------------------------------------------------------------------- output


# ----------------------------------------------------------------------------- main


@dataclass
class Ctx:
    args: argparse.Namespace
    url: str
    model: str
    timeout: float
    client: httpx.AsyncClient


async def run_phases(args) -> list[PhaseResult]:
    limits = httpx.Limits(max_connections=args.burst + 50, max_keepalive_connections=20)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        model = (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        ctx, results = Ctx(args, args.url, model, args.timeout, client), []
        sampler = RssSampler(args.url)
        sampler.start()
        try:
            for phase in args.phases:
                kinds = (
                    [*args.kill_kinds, *(["ingress"] if args.kill_ingress else [])]
                    if phase == "kill"
                    else [None]
                )
                for kind in kinds:
                    t0, before = time.monotonic(), sampler.snapshot()
                    res = await (phase_kill(ctx, kind) if kind else PHASES[phase](ctx))
                    res.rss = sampler.window(t0, before, sampler.snapshot())
                    print_phase(res)
                    results.append(res)
        finally:
            sampler.stop()
    return results


PHASES = {
    "bad": phase_bad,
    "burst": phase_burst,
    "disconnect": phase_disconnect,
    "media": phase_media,
}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--phases", default="bad,burst,kill,disconnect")
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--media-burst", type=int, default=6, help="media phase: concurrent requests")
    ap.add_argument("--media-images", type=int, default=4, help="media phase: images per request")
    ap.add_argument(
        "--media-megapixels", type=float, default=16.0, help="media phase: size of each image"
    )
    ap.add_argument(
        "--timeout", type=float, default=30.0, help="no answer within this many seconds = a hang"
    )
    ap.add_argument(
        "--kill-delay",
        type=float,
        default=1.0,
        help="seconds between the first request and the SIGKILL",
    )
    ap.add_argument(
        "--kill-spread",
        type=float,
        default=3.0,
        help="the 20 kill-phase requests start over this many seconds",
    )
    ap.add_argument(
        "--kill-kinds", default=",".join(KINDS), help="worker kinds the kill phase kills, in turn"
    )
    ap.add_argument(
        "--kill-ingress", action="store_true", help="also SIGKILL the ingress Serve replica"
    )
    ap.add_argument("--recover-timeout", type=float, default=120.0)
    ap.add_argument(
        "--drain-s", type=float, default=10.0, help="worker state must return to 0 within this"
    )
    ap.add_argument("--json", default=None, help="also write all results here")
    args = ap.parse_args()
    args.url, args.phases = (
        args.url.rstrip("/"),
        [p.strip() for p in args.phases.split(",") if p.strip()],
    )
    args.kill_kinds = [k for k in args.kill_kinds.split(",") if k in KINDS]
    host = httpx.URL(args.url).host
    if host not in ("127.0.0.1", "localhost", "::1"):
        ap.error(f"--url must be a loopback address (this probe kills local processes), got {host}")
    if unknown := set(args.phases) - {*PHASES, "kill"}:
        ap.error(f"unknown phases: {sorted(unknown)}")
    results = asyncio.run(run_phases(args))
    print_summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
