#!/usr/bin/env python
"""Hardening probe against a RUNNING epd server: one request must never harm another,
bounded media memory, nothing leaks, back-pressure, retries instead of lost requests.

    python scripts/probe_server.py --url http://127.0.0.1:8000 [--phases bad,burst,kill,disconnect]
        [--burst 200] [--timeout 30] [--kill-kinds encoder,prefill,decode] [--kill-ingress] [--json out.json]

Phases: bad (raw bad-input cases), burst (N concurrent requests), media (concurrent
requests with several large images each: ingress RSS before / peak / after), kill (SIGKILL one worker
of each kind mid-traffic; --kill-ingress also the ingress replica), disconnect (clients
drop streams; worker state must drain). RSS of the ingress and every worker is sampled
every 0.2 s throughout. Only the given (loopback) URL is contacted; every loop is bounded.
Helpers: probe_cases.py (the bad-input bodies), probe_client.py (one request, classified),
probe_rss.py (pids and RSS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_cases as pc  # noqa: E402
from probe_client import Outcome, chat_body, is_openai_error, run_chat  # noqa: E402
from probe_rss import GROUPS, RssSampler, ingress_pid, worker_pids  # noqa: E402

KINDS = ("encoder", "prefill", "decode")
DRAIN_FIELDS = (
    "held_kv",
    "held_embeddings",
    "rows",
    "running",
    "queued",
    "kv_reserved_bytes",
    "cache_encoding_entries",
    "cache_referenced_entries",
)


@dataclass
class BadRow:
    case: str
    modality: str | None
    applies: bool  # False: the case is about media the served model does not take
    status: int | None  # None: hang or connection error
    openai_shape: bool
    latency_ms: float
    message: str


@dataclass
class PhaseResult:
    phase: str
    cases: int = 0
    n2xx: int = 0
    n4xx: int = 0
    n5xx: int = 0
    hangs: int = 0
    lost: int = 0
    recover_s: float | None = None
    note: str = ""
    rss: dict = field(default_factory=dict)  # group -> [before, peak, after] MB
    rows: list = field(default_factory=list)


def count(result: PhaseResult, outcomes: list[Outcome]) -> None:
    for o in outcomes:
        status = o.status or 0
        result.cases += 1
        result.n2xx += 200 <= status < 300 and not (o.lost or o.broken)
        result.n4xx += 400 <= status < 500
        result.n5xx += status >= 500 or (
            status == 200 and (o.lost or o.broken)
        )  # in-band errors are server errors
        result.hangs += o.hang
        result.lost += o.lost and not o.hang


# ----------------------------------------------------------------------------- phases


async def phase_bad(ctx) -> PhaseResult:
    result, takes = PhaseResult("bad"), await detect_modalities(ctx)
    canaries, harmed = 0, []
    for i, case in enumerate(tqdm(pc.all_cases(ctx.model), desc="bad", unit="case")):
        row = await send_case(ctx, case)
        row.applies = case.modality is None or case.modality in takes
        result.rows.append(row)
        if (
            i % 5 == 4 or (row.status or 500) >= 500
        ):  # every 5th case and after every failure: still serving?
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
        f"(after: {', '.join(harmed) or 'none'}); 5xx/hang: {names(lambda r: (r.status or 500) >= 500)}; "
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
    result = PhaseResult("burst")
    bodies = [chat_body(ctx.model, seed=i) for i in range(ctx.args.burst)]
    outcomes = await gather_bar(
        [run_chat(ctx.client, ctx.url, b, ctx.timeout) for b in bodies], "burst"
    )
    count(result, outcomes)
    lat = sorted(o.latency_s for o in outcomes if o.ok)
    by = lambda pred: sum(1 for o in outcomes if pred(o))  # noqa: E731
    p50, p99 = (
        (lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]) if lat else (None, None)
    )
    result.rows = [
        {
            "200": by(lambda o: o.status == 200),
            "429": by(lambda o: o.status == 429),
            "429_with_retry_after": by(lambda o: o.status == 429 and o.retry_after),
            "503": by(lambda o: o.status == 503),
            "other_5xx": by(lambda o: (o.status or 0) >= 500 and o.status != 503),
            "hangs": by(lambda o: o.hang),
            "p50_s": p50,
            "p99_s": p99,
        }
    ]
    result.note = " ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.rows[0].items()
    )
    return result


async def phase_media(ctx) -> PhaseResult:
    """Concurrent requests each carrying several large images: does the ingress's memory come back?"""
    result, a = PhaseResult("media"), ctx.args
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
    count(
        result,
        await gather_bar([run_chat(ctx.client, ctx.url, b, ctx.timeout) for b in bodies], "media"),
    )
    result.note = f"{a.media_burst} requests x {a.media_images} x {a.media_megapixels:g} MP JPEG"
    await asyncio.sleep(2.0)  # let the ingress settle before the 'after' sample
    return result


async def gather_bar(coros, desc: str) -> list:
    bar = tqdm(total=len(coros), desc=desc, unit="req")

    async def one(c):
        try:
            return await c
        finally:
            bar.update()

    try:
        return await asyncio.gather(*[one(c) for c in coros])
    finally:
        bar.close()


async def phase_kill(ctx, kind: str) -> PhaseResult:
    result = PhaseResult(f"kill:{kind}")
    pids = (
        [await asyncio.to_thread(ingress_pid, ctx.url)]
        if kind == "ingress"
        else (await asyncio.to_thread(worker_pids, ctx.url)).get(kind, [])
    )
    pid = next((p for p in pids if p), None)
    if pid is None:
        result.note = f"no {kind} pid found; skipped"
        return result
    images = (
        [pc.png(96, 96, seed=1000 + i) for i in range(20)] if kind == "encoder" else [None] * 20
    )
    bodies = [
        chat_body(ctx.model, words=24, max_tokens=32, stream=i % 2 == 0, image=img, seed=i)
        for i, img in enumerate(images)
    ]
    requests = [
        asyncio.ensure_future(staggered(ctx, b, i * ctx.args.kill_spread / len(bodies)))
        for i, b in enumerate(bodies)
    ]
    await asyncio.sleep(ctx.args.kill_delay)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    recovery = asyncio.ensure_future(wait_recovered(ctx, kind, pid, killed_at))
    outcomes = await gather_bar(requests, f"kill {kind} (pid {pid})")
    count(result, outcomes)
    result.recover_s, result.rows = await recovery, [asdict(o) for o in outcomes]
    broken = [o for o in outcomes if o.broken]
    result.note = (
        f"killed pid {pid}; ok={sum(o.ok for o in outcomes)} lost={result.lost} broken_mid_stream={len(broken)} "
        f"(clean error event {sum(o.clean_error for o in broken)}) hung={result.hangs}"
    )
    return result


async def staggered(ctx, body: dict, delay: float) -> Outcome:
    # A tiny model answers 20 requests in about a second: spreading the arrivals keeps some
    # in flight at the kill and sends others to the dead worker before anyone noticed.
    await asyncio.sleep(delay)
    return await run_chat(ctx.client, ctx.url, body, ctx.timeout)


async def wait_recovered(ctx, kind: str, pid: int, since: float) -> float | None:
    """Seconds from the kill until /health is 200 without the killed pid and a fresh chat
    succeeds (health alone can still say 200 before the supervisor notices the death)."""
    deadline = since + ctx.args.recover_timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        try:
            resp = await ctx.client.get(f"{ctx.url}/health", params={"verbose": 1}, timeout=5)
        except httpx.HTTPError:
            continue
        if resp.status_code != 200:
            continue
        pids = {w.get("pid") for ws in (resp.json().get("workers") or {}).values() for w in ws}
        if kind == "ingress":
            pids = {await asyncio.to_thread(ingress_pid, ctx.url)}
        if pid not in pids and (await run_chat(ctx.client, ctx.url, chat_body(ctx.model), 10)).ok:
            return round(time.monotonic() - since, 2)
    return None


async def phase_disconnect(ctx) -> PhaseResult:
    result = PhaseResult("disconnect")
    bodies = [
        chat_body(ctx.model, words=400, max_tokens=64, stream=True, seed=i) for i in range(30)
    ]

    async def drop(body, n):  # own client per stream: closing it surely closes the socket
        async with httpx.AsyncClient(timeout=ctx.timeout) as client:
            return await run_chat(client, ctx.url, body, ctx.timeout, stop_after=n)

    outcomes = await gather_bar([drop(b, 1 + i % 2) for i, b in enumerate(bodies)], "disconnect")
    count(result, outcomes)
    closed_at = time.monotonic()
    leaked, drained_s = await wait_drained(ctx, closed_at + ctx.args.drain_s)
    result.rows = [{"worker": w, "field": f, "value": v} for w, f, v in leaked]
    drained = (
        f"drained in {drained_s - closed_at:.1f}s"
        if drained_s
        else f"NOT drained after {ctx.args.drain_s:.0f}s"
    )
    result.note = f"{drained}; leaked: " + (
        ", ".join(f"{w}.{f}={v}" for w, f, v in leaked) or "none"
    )
    return result


async def wait_drained(ctx, deadline: float) -> tuple[list, float | None]:
    leaked = [("health", "unreachable", 1)]
    while True:
        try:
            resp = await ctx.client.get(f"{ctx.url}/health", params={"verbose": 1}, timeout=5)
            workers = resp.json().get("workers") or {}
            leaked = [
                (f"{kind}{i}", f, w[f])
                for kind, ws in workers.items()
                for i, w in enumerate(ws)
                for f in DRAIN_FIELDS
                if w.get(f)
            ]
            if resp.status_code == 200 and not leaked:
                return [], time.monotonic()
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return leaked, None
        await asyncio.sleep(0.5)


# ----------------------------------------------------------------------------- output


def table(headers: list[str], rows: list[list]) -> str:
    cells = [
        [("-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)) for v in r]
        for r in rows
    ]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    line = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def print_phase(result: PhaseResult) -> None:
    print(f"\n== {result.phase}: {result.note}")
    if result.phase == "bad":
        print(
            table(
                ["case", "media", "applies", "status", "openai_shape", "ms", "message"],
                [
                    [
                        r.case,
                        r.modality or "",
                        r.applies,
                        r.status if r.status else "HANG/ERR",
                        r.openai_shape if (r.status or 0) >= 400 else "",
                        r.latency_ms,
                        r.message,
                    ]
                    for r in result.rows
                ],
            )
        )
    print(
        table(
            ["process", "RSS MB before", "peak", "after"],
            [[g, *result.rss.get(g, [None] * 3)] for g in GROUPS],
        )
    )


def print_summary(results: list[PhaseResult]) -> None:
    def mb(r, groups):
        vals = [r.rss.get(g) for g in groups if r.rss.get(g)]
        return "/".join(f"{sum(v[i] for v in vals):.0f}" for i in range(3)) if vals else "-"

    rows = [
        [
            r.phase,
            r.cases,
            r.n2xx,
            r.n4xx,
            r.n5xx,
            r.hangs,
            r.lost,
            r.recover_s,
            mb(r, ["ingress"]),
            mb(r, KINDS),
        ]
        for r in results
    ]
    print("\n== summary (RSS in MB: before/peak/after; workers summed)")
    print(
        table(
            [
                "phase",
                "cases",
                "2xx",
                "4xx",
                "5xx",
                "hangs",
                "lost",
                "recover_s",
                "ingress RSS",
                "worker RSS",
            ],
            rows,
        )
    )
    print("\n".join(f"  {r.phase}: {r.note}" for r in results))


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
